"""Pid moves: the protocol driver, its views of the control log, and its Kafka adapter.

`driver` plans the next assignment as a pure function of the control view and the instances'
liveness; `views` reads moves and requests out of a control view; `kafka_mover` reads and writes Kafka
around them (the control topic, the instances' transactional ids, `fluxjoin move`'s requests).
"""
