"""Generators for the deployment stack: the Helm chart's schema, CRD and RBAC files, Prometheus rules, dashboard.

Every generated file is committed; `python -m deploy` (or `make chart`) rewrites them and
`python -m deploy --check` fails when a committed file drifts from its generator.
"""
