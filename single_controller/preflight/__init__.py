"""The checks a config passes before anything starts: its rules, the environment it names, and the loader."""
