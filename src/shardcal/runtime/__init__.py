"""Foundation: every collective (:mod:`.distributed`), rank status and failure diagnosis (:mod:`.health`), the local
process launcher (:mod:`.launcher`), host memory (:mod:`.hostmem`), named fault points for tests (:mod:`.faults`),
atomic files (:mod:`.fsutil`) and parameter-table checks (:mod:`.params`)."""
