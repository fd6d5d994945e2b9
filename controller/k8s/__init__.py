"""The JoinPipeline operator: reconciles every pipeline in one namespace, one leader at a time.

For each JoinPipeline it owns an instance StatefulSet (a checkpoint volume per pod), the ConfigMap its
pods read their configuration from, its headless Service and a PodDisruptionBudget, and it keeps the
number of instances at spec.replicas without ever leaving a pid without an owner: on scale-out it grows
the StatefulSet first and moves pids onto the new instances once they report ready; on scale-in it moves
every pid off the highest ordinals first and shrinks the StatefulSet only when they own nothing.

Pure, without the `kubernetes` client or any I/O: `spec` (a JoinPipeline read into a `PipelineSpec`),
`manifests` (the objects it owns), `status` (its status subresource). Around them: `ports` (the
`PidMover` that carries moves out), `api` (the operator's calls to the API server), `lease` (leader
election), `reconciler` (the `Operator`: its loop and its rounds), `health` (/healthz and /metrics) and
`main` (`fluxjoin operator`'s options and entry point).
"""
