"""fluxjoin control plane and runtimes: CLI, local supervisor (embedded Kafka, demo), benchmarks,
policies and the Kubernetes operator."""
