"""Config: YAML -> ``${VAR}`` expansion -> validated models -> cross-references -> frozen settings.

Every problem is collected, located by a dotted path (``engines.local.abort.timeout_s``) and the
file line, and raised together as one :class:`~sidecar.errors.ConfigError`; ``cancel-sidecar
--check-config`` prints them and exits 1. Unknown keys are rejected, so a typo never silently
falls back to a default; no secret is ever printed, not even in an error message.

The modules, in the order a file goes through them::

    source.py      text -> YAML tree with the line of every dotted path (a key given twice is a
                   problem); ${VAR} and ${VAR:-default} expanded from the environment
    values.py      named value types (Port, Seconds, EngineKind, ...) and the checks behind them
    schema.py      the frozen models, unknown keys rejected; Settings is the whole file
    references.py  checks across sections, on the tree (every route names a defined engine)
    secrets.py     masking: what no message shows (secrets, unknown keys' values, URL userinfo)
    load.py        parse_config / load_config: the steps above, each problem located, with a
                   did-you-mean hint where one helps, masked, raised as one ConfigError
    exposure.py    open_cancel_api / warn_open_cancel_api: a cancel API open beyond loopback

A running sidecar re-reads the file on SIGHUP (see :mod:`sidecar.runtime`): engines, routes,
upstream, downstream (but ``downstream.idle_timeout_s``), tunnel and lifecycle apply to new
requests; listen, admin, log_level, log_format and ``downstream.idle_timeout_s`` need a restart.
"""

from sidecar.config.exposure import open_cancel_api, warn_open_cancel_api
from sidecar.config.load import load_config, parse_config
from sidecar.config.schema import (
    AbortFromHeaderSettings,
    AbortSettings,
    AdminSettings,
    DownstreamSettings,
    EngineSettings,
    LifecycleSettings,
    Listener,
    RouteSettings,
    Settings,
    TunnelSettings,
    UpstreamSettings,
    default_record_dir,
)
from sidecar.config.secrets import SHORT_SECRET
from sidecar.config.values import (
    KINDS_WITHOUT_ABORT,
    MAX_SECONDS,
    AllowEntry,
    EngineKind,
    LogLevel,
    NotBool,
    OptionalSeconds,
    Port,
    RoutePrefix,
    Seconds,
    SecondsOrZero,
    WhenAbortUnavailable,
    dns_name,
)
from sidecar.errors import ConfigError, ConfigProblem

__all__ = [
    "KINDS_WITHOUT_ABORT",
    "MAX_SECONDS",
    "SHORT_SECRET",
    "AbortFromHeaderSettings",
    "AbortSettings",
    "AdminSettings",
    "AllowEntry",
    "ConfigError",
    "ConfigProblem",
    "DownstreamSettings",
    "EngineKind",
    "EngineSettings",
    "LifecycleSettings",
    "Listener",
    "LogLevel",
    "NotBool",
    "OptionalSeconds",
    "Port",
    "RoutePrefix",
    "RouteSettings",
    "Seconds",
    "SecondsOrZero",
    "Settings",
    "TunnelSettings",
    "UpstreamSettings",
    "WhenAbortUnavailable",
    "default_record_dir",
    "dns_name",
    "load_config",
    "open_cancel_api",
    "parse_config",
    "warn_open_cancel_api",
]
