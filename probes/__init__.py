"""Built-in probe workloads: each module exposes ``build() -> autotune.Workload``."""
