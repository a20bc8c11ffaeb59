"""Every collective the engine issues: the Communicator (accounting, positions, bounded
waits; comm), the collectives themselves with in-band headers (collectives), bounded
waits (bounded) and the failure reports that name every rank's position (diagnosis).
The cross-rank agreement built on them is zero_strategy.agreement."""
