"""The operator's command line for people: ``status``, ``diagnose`` and ``check`` (:mod:`.main`)."""
