"""Deployment files (templates for cluster launch scripts); data, no code."""
