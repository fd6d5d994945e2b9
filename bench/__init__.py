"""fluxjoin's benchmarks (`fluxjoin bench ...`): throughput against Spark's built-in join and latency,
static vs flux under skew, the cost of a move, flux's convergence after a load shift, a soak of random
moves under faults, a long control log's fold, and the generator's rate.

They drive a local pipeline (`local.processes`) and measure it; nothing in the pipeline, the controller
or the operator imports them, so they live apart from the code they measure. `bench.run` holds what
several of them share.
"""
