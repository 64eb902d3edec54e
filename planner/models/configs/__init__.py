"""The zoo families' configurations, importable without torch."""
