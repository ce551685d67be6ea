"""The ``shardcal`` command (:mod:`.main`)."""
