"""Planner: pure layout math and capacity estimates, shared by the code that moves weights and by `miles-hpc plan`.

`transfer` (boxes of tensors, who holds what, the p2p transfer plan: who sends which range to whom) and
`estimate` (memory per GPU and weight-sync time for a cluster layout). Imports nothing of ours outside this
package, so the engine, the trainer and the sync strategies can all use the same functions.
"""
