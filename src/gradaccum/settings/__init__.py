"""Settings as components: one small dataclass per concern, owned by the package that uses it,
assembled per command; the command line, `--config` files and the run folder's `config.yaml`
all come from them.

- `field`: how a field is given and read (`setting`, `Flag`, `read_value`); its docstring is
  its help (`docs`).
- `command`: a command's components and per-task defaults (`Command`), and the one parser
  generator (`add_command`): a group per component, every flag defined once.
- `files`: `--config FILE` (YAML, TOML or JSON; flat keys or a section per component) and
  the resolved settings written back as YAML.

No torch here: every command's parser is built for `gradaccum plan` too.
"""
