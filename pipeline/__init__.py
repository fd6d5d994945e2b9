"""fluxjoin's data plane: shared wire contracts (partitioning, codec, configuration), the Spark join
instance (source, stateful join operator, exactly-once sink) and the offline oracle."""
