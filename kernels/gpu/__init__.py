"""GPU tooling around the kernels: the one-call GPU check, the kernel benchmark, kernel A/B comparisons, the end-to-end
and runner comparisons, and the static inspector of compiled kernels (which runs without a GPU)."""
