"""The laptop runtime: the embedded Kafka broker (`kafka_runtime`; its jars `kafka_dist`, its configuration
`kafka_config`), a pipeline's processes on this machine (`processes`) with their CPU budgets
(`cpu_budget`), and `fluxjoin demo` (`demo`).

Apart from the controller because none of it runs in a deployment: the demo, the benchmarks and the
integration tests run the pipeline here, each part a `python -m fluxjoin` process, as a user does.
"""
