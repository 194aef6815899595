"""The Manager's parts, each with one job (docs/design.md, "Layers"): ``ft/manager.py`` keeps
the Manager's public face (torchft's names and signatures) and the step protocol, and hands
the rest to these:

* ``wiring``: the replica group's links, made once at start and closed at shutdown: the
  store, the ManagerServer, the lighthouse and ManagerServer clients, the checkpoint
  transport and its Healer.
* ``state_dicts``: the registered state-dict functions, the lock that keeps the training
  thread's writes from a heal source's reads, and a received state waiting to be applied.
* ``step_errors``: the step's first error, where it arose, whether it aborted the group
  (and ExceptionWithTraceback, torchft's type for it).
* ``heal``: the Healer, the Manager's use of the checkpoint transport.
* ``step_failures``: the persistent-failure rule (pure); ``step_outcomes``: its state from
  step to step (the streak, the backoff owed, the last step's error).
* ``progress_watch``: a stalled replica says why.

None of these imports the Manager; each is tested on its own (tests/manager).
"""
