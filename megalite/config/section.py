"""A section of the run configuration: the flags one component is built from, as a frozen dataclass whose fields
are named as their flags' destinations (so each flag is still declared once, in the parser; the section only says
who reads it, and carries no defaults: the parser's are the only ones). A component takes its section, never the
flag namespace (tests/test_house.py counts the reads of the namespace that remain below the command line);
`Section.of(run_config)` makes one, in config/ or where a run is set up."""

import dataclasses

# a field that is no flag of its own (made from the flags by the section's `of`): dataclasses.field(metadata=DERIVED)
DERIVED = {"derived": True}


class Section:
    @classmethod
    def of(cls, args, **derived):
        """This section of a validated run configuration (config/run.py); `derived`: its DERIVED fields."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                      if not f.metadata.get("derived")}, **derived)
