"""Imported first by the fork server (api.service.jobs.PRELOAD): the fork server exits within
a quarter second of its replica's death, even while it is still importing the rest of its
preload list (torch alone takes seconds), instead of when that is done.

The replica names itself in AUTOPAR_REPLICA_PID only while it starts the fork server, so
importing this module anywhere else does nothing."""

from __future__ import annotations

import os

from executor.lifetime import exit_when_gone

exit_when_gone(os.environ.get("AUTOPAR_REPLICA_PID"))
