"""The user's own defaults: set a profile and an account once, not in every command.

They sit beneath every config file, from lowest to highest: the profile of a known cluster detected
from this host (a shipped profile's `detect:`), the user file (`$GPTPAR_USER_CONFIG`, else
`$XDG_CONFIG_HOME/gptpar/config.yaml`, else `~/.config/gptpar/config.yaml`; any config keys), then
SBATCH_ACCOUNT, GPTPAR_ACCOUNT and GPTPAR_PROFILE. They apply only where a config is first resolved
(`gptpar train` as the submitter, `submit`, `sweep`, `config show`, `doctor`), so the run's config.yaml
records them; a job's ranks read that file alone and never these defaults.
"""

from __future__ import annotations

import fnmatch
import os
import socket
import typing
from pathlib import Path

from gptpar.cluster.profiles import load_profile, profile_names
from gptpar.config import Config, Layer, config_layers, nested, read_yaml, resolve_layers
from gptpar.paths import check_path
from gptpar.run.start import location_layer

# (variable, key), lowest first: GPTPAR_ACCOUNT wins over SLURM's own SBATCH_ACCOUNT.
ENV_KEYS = (("SBATCH_ACCOUNT", "launch.account"), ("GPTPAR_ACCOUNT", "launch.account"),
            ("GPTPAR_PROFILE", "launch.profile"))


def user_file(env: typing.Mapping[str, str]) -> Path:
    if env.get("GPTPAR_USER_CONFIG"):
        return Path(env["GPTPAR_USER_CONFIG"]).expanduser()
    config_home = Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return config_home / "gptpar" / "config.yaml"


def detected_profile(hostname: str, env: typing.Mapping[str, str]) -> tuple[str, str] | None:
    """The shipped profile whose `detect:` matches this host, and the mark that matched: a host-name
    pattern, or a variable a site sets on every node (NERSC_HOST=perlmutter). Only such reliable marks count."""
    for name in profile_names():
        detect = load_profile(name).get("detect") or {}
        if any(fnmatch.fnmatch(hostname, pattern) for pattern in detect.get("hostnames") or ()):
            return name, f"host {hostname}"
        for var, value in (detect.get("env") or {}).items():
            if env.get(var) == str(value):
                return name, f"{var}={value}"
    return None


def user_layers(env: typing.Mapping[str, str] | None = None, hostname: str | None = None) -> list[Layer]:
    """The user's defaults as config layers, lowest first, each named for `gptpar config show`."""
    env = os.environ if env is None else env
    hostname = socket.gethostname() if hostname is None else hostname
    layers: list[Layer] = []
    detected = detected_profile(hostname, env)
    if detected:
        layers.append((f"detected cluster ({detected[1]})", nested({"launch.profile": detected[0]})))
    path = user_file(env)
    if env.get("GPTPAR_USER_CONFIG"):  # a file named on purpose must be there
        check_path(path, "file", "GPTPAR_USER_CONFIG", "name a YAML file of config defaults, or unset it")
    if path.exists():  # the default file may be absent, not a folder
        check_path(path, "file", "user file", "make it a YAML file of config defaults")
        layers.append((f"user file {path}", read_yaml(path)))
    layers += [(f"environment {var}", nested({key: env[var]})) for var, key in ENV_KEYS if env.get(var)]
    return layers


def resolve_config(path: str | Path | None, overrides: typing.Iterable[str], user: bool = True
                   ) -> tuple[Config, dict[str, str]]:
    """The config a command resolves first, with where each key came from; `user=False` for a job's
    ranks, which take their config file as it is. A config file in a run folder names that run where the
    folder is now (gptpar.run.start.location_layer); the command line still wins."""
    return resolve_layers([*(user_layers() if user else []), *config_layers(path),
                           *(location_layer(path) if path else []), *config_layers(None, overrides)])
