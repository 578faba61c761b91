"""Mixed-depth execution, engine-independent (torch + triton only): the route tape, cohort maps, count-bounded
cohort GEMMs (Triton on GPU, torch ops on CPU), per-device tile tables, paged-KV attention with the RUN mask and
the Project-Only path, and routed decoder layers. An engine integration only calls into this package."""
