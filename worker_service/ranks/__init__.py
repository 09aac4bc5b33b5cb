"""A node's ranks behind one protocol (`rank_api.Ranks`): in-process (`runner_keeper`, tp_size 1)
or rank processes fed by a shared-memory ring (`rank_group`, `rank_set`, `rank_process`)."""
