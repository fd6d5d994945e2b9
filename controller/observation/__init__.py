"""What the controller observes of the instances: whether they live, and their load.

The metrics topic carries the instances' heartbeats, batch records and read reports (`observer`); from
them come the liveness judgement (`liveness`), the per-instance estimators over batch records
(`estimates`), the pids' arrival rates and the instances' warm-up (`rates`), and the policies'
`Snapshot` (`snapshot`). Nothing here moves a pid or decides one: the move driver (`controller.moves`)
and the policy rounds (`controller.rounds`) read what this package measures.
"""
