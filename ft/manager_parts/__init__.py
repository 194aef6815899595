"""The Manager's parts, each with one job (docs/design.md, "Layers"): ``ft/manager.py`` keeps
the Manager's public face (torchft's names and signatures) and drives these through a step:

* ``settings``: the Manager's keywords and the environment, resolved and checked.
* ``assembly``: builds the parts below and says which gets which collaborator.
* ``step_state``: the step's counters, its quorum and this replica's participation, which
  the parts share.
* ``quorum_round``: one step's quorum on the worker thread (the call, participation, the
  group rebuilt for a new quorum, then the heal).
* ``group_rebuild``: how a process group is rebuilt (``configure()`` or
  ``reconfigure(opts)``) and how its errors are read.
* ``heal_duties``: when a heal is sent, received and applied within the step; ``heal``: the
  Healer, the transfer itself through the checkpoint transport.
* ``commit_vote``: the vote, the counters after it, ``max_retries`` and the backoff.
* ``managed_work``: the Manager's collectives as Works that report failures, never raise.
* ``step_queries``: the accessors a training loop calls, and torchft's private names.
* ``wiring``: the replica group's links, made once at start and closed at shutdown: the
  store, the ManagerServer, the lighthouse and ManagerServer clients, the checkpoint
  transport and its Healer.
* ``state_dicts``: the registered state-dict functions and the lock that keeps the training
  thread's writes from a heal source's reads.
* ``step_errors``: the step's first error, where it arose, whether it aborted the group
  (and ExceptionWithTraceback, torchft's type for it).
* ``step_failures``: the persistent-failure rule (pure); ``step_outcomes``: its state from
  step to step (the streak, the backoff owed, the last step's error).
* ``step_log``: the structured log lines; ``progress_watch``: a stalled replica says why.

None of these imports the Manager; each is tested on its own where it can be (tests/manager).
"""
