"""`python3 -m tessera.config > configs/base.yml` regenerates base.yml from the schema."""

from tessera.config.schema import render_base_yml

print(render_base_yml(), end="")
