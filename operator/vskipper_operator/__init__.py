"""vSkipper's Kubernetes operator: `SkipperDeployment` resources become per-GPU-class vSkipper servers.

`crd` defines the custom resource (schema, CEL rules, printer columns, subresources) once; `plan` is the pure
function from a resource and the cluster's nodes to the desired objects; `handlers` are the thin Kopf handlers
that apply a plan; `probe` is the bandwidth benchmark a probe Job runs; `cli` is `vskipper-operator`.
Importing this package imports no torch and no Kubernetes client.
"""
