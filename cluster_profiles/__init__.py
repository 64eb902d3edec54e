"""Bundled cluster profiles (YAML data, no code). Loaded by planner.cluster.profile."""
