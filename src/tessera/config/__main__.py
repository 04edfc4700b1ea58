"""Print a config without running anything.

    .venv/bin/python -m tessera.config configs/base.yml model_name=llama3.1-8b steps=10   # the resolved config
    .venv/bin/python -m tessera.config > configs/base.yml                                  # regenerate base.yml

With arguments (as given to train.py): the config the trainer would run, every key after the
model file, the key=value arguments and the M_<KEY> environment variables, as flat YAML under the
header of a run's config.yml (saved to a file and given back as a config file, it is read as it
stands, the model file not applied again); what
the loader logs (MaxText's spellings it translated, ...) goes to stderr, as train.py logs it.
Without: configs/base.yml as generated from the schema, every key with its default and comment.
"""

import sys

import yaml

from tessera.config import ConfigError, flat_dict, load_config
from tessera.config.checks import validate_for_build
from tessera.config.schema import render_base_yml
from tessera.config.yaml_file import RUN_CONFIG_HEADER
from tessera.tools.cli import UsageError, exit_if_help, help_text, resolve_config_file


def config_help() -> str:
    return help_text(
        ".venv/bin/python -m tessera.config [configs/base.yml [key=value ...]]",
        "With a config file and key=value arguments (as given to train.py): print the resolved config,\n"
        "after configs/models/<model_name>.yml, the arguments and M_<KEY> environment variables, without\n"
        "training. Without arguments: print configs/base.yml as generated from the schema\n"
        "(`.venv/bin/python -m tessera.config > configs/base.yml` regenerates it). Exit 2 on a config error.",
        docs=("configs/base.yml (every key, its default and comment)", "README.md#configuration"))


def main(argv: list[str]) -> int:
    exit_if_help(argv, config_help)
    if not argv:
        print(render_base_yml(), end="")
        return 0
    try:
        cfg = load_config(resolve_config_file(argv))
        validate_for_build(cfg.model)
    except (ConfigError, UsageError) as e:
        print(f"{'config ' if isinstance(e, ConfigError) else ''}error: {e}", file=sys.stderr)
        return 2
    # the header of a run's config.yml: saved and given back as a config file, it is read as it stands (without it
    # the model file's values won again: model_name=llama2-7b base_num_decoder_layers=4 printed 4 and trained 32)
    print(RUN_CONFIG_HEADER + yaml.safe_dump(flat_dict(cfg), sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    import logging

    from tessera.tools.cli import run_printing

    # on stderr, as train.py logs them: the aliases and MaxText spellings read, the model file's values that
    # win over a config file's (stdout stays the YAML)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname).1s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr)
    sys.exit(run_printing(main, sys.argv[1:]))
