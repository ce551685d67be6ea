"""The ``shardcal`` command (:mod:`.main`), one module per subcommand (``*_command``) and their registry
(:mod:`.commands`)."""
