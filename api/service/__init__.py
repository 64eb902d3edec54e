"""The REST service (FastAPI): `create_app()` in api.service.app."""
