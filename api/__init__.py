"""autopar front door: the `autopar` CLI and (later) the REST service."""
