"""fluxjoin control plane: policies, pid moves, the controller's rounds and the Kubernetes operator."""
