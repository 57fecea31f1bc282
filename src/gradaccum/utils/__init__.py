"""Small utilities every part uses: `errors` (bad input as one line, runs that cannot go on),
`atomic` (files written whole or not at all; a full disk as one line), `sizes` (4M tokens,
80GiB, 300ms as people type them, parsed and printed), `jsonable` (JSON with
finite numbers only). No torch here: the planner imports them."""
