"""How a process proves who it is to NATS and encrypts the connection (settings → nats.connect).

Contract:

* :func:`security_options` turns the credentials and TLS fields of a
  :class:`~shared.settings.ServiceSettings` (``VTM_NATS_CREDS``, ``VTM_NATS_NKEY_SEED``,
  ``VTM_NATS_TOKEN``, ``VTM_NATS_USER`` / ``VTM_NATS_PASSWORD``, ``VTM_NATS_TLS_CA``,
  ``VTM_NATS_TLS_CERT`` / ``VTM_NATS_TLS_KEY``, ``VTM_NATS_TLS_HOSTNAME``) into ``nats.connect``
  keyword arguments. Every connection a vertumnus process opens passes them (a service's own,
  a rank host's, the torch KV hand-off's, the decode role's, ``vertumnus replay --nats`` /
  ``tap``'s), so one set of variables secures a whole deployment.
* With none of them set it returns ``{}``: nats-py's defaults, i.e. a user:password in
  ``VTM_NATS_URL`` still works, and a ``tls://`` URL still gets TLS with the system's CAs.
* TLS is on when a CA or a client certificate is given. The context verifies the server
  against ``VTM_NATS_TLS_CA`` (the system's CAs when unset) and presents the client
  certificate when one is given (a server with ``verify: true``). A file that cannot be read
  or is not a certificate / key raises :class:`~shared.ids.InvalidInput` naming the setting,
  which a service's main reports as "cannot start".
* Which combinations are allowed is checked by the settings themselves (one way of
  authenticating at most, a password with a user, a key with a certificate); files are read
  here, at connect time, so a rotated certificate is picked up by a restart.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from shared.ids import InvalidInput

if TYPE_CHECKING:
    from shared.settings import ServiceSettings

SECURITY_FIELDS: Final[frozenset[str]] = frozenset({
    "nats_creds", "nats_nkey_seed", "nats_token", "nats_user", "nats_password", "nats_tls_ca",
    "nats_tls_cert", "nats_tls_key", "nats_tls_hostname",
})
"""The :class:`~shared.settings.ServiceSettings` fields :func:`security_options` reads: the
only settings a command-line tool that connects with ``--nats`` takes from its environment
(:func:`env_nats_security_options`)."""


def tls_context(settings: ServiceSettings) -> ssl.SSLContext | None:
    """The client TLS context of ``settings`` (None: no TLS setting given)."""
    ca, cert, key = settings.nats_tls_ca, settings.nats_tls_cert, settings.nats_tls_key
    if ca is None and cert is None:
        return None
    try:
        ctx = ssl.create_default_context(cafile=str(ca) if ca is not None else None)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidInput(f"VTM_NATS_TLS_CA {str(ca)!r} is not a readable CA bundle: "
                           f"{exc}") from None
    if cert is not None:
        try:
            ctx.load_cert_chain(str(cert), str(key) if key is not None else None)
        except (OSError, ssl.SSLError) as exc:
            raise InvalidInput(
                f"VTM_NATS_TLS_CERT {str(cert)!r} / VTM_NATS_TLS_KEY {str(key)!r} are not a "
                f"readable certificate and its private key: {exc}") from None
    return ctx


def security_options(settings: ServiceSettings) -> dict[str, Any]:
    """``nats.connect`` keyword arguments for ``settings``' credentials and TLS (module doc)."""
    opts: dict[str, Any] = {}
    if settings.nats_creds is not None:
        opts["user_credentials"] = str(settings.nats_creds)
    if settings.nats_nkey_seed is not None:
        opts["nkeys_seed"] = str(settings.nats_nkey_seed)
    if settings.nats_token is not None:
        opts["token"] = settings.nats_token.get_secret_value()
    if settings.nats_user is not None:
        opts["user"] = settings.nats_user
        if settings.nats_password is not None:
            opts["password"] = settings.nats_password.get_secret_value()
    ctx = tls_context(settings)
    if ctx is not None:
        opts["tls"] = ctx
    if settings.nats_tls_hostname is not None:
        opts["tls_hostname"] = settings.nats_tls_hostname
    return opts


def env_security_options() -> dict[str, Any]:
    """:func:`security_options` of the ``VTM_NATS_*`` variables of this process's environment
    (a command-line tool's connections: ``vertumnus replay --nats``, ``tap``, ``up``'s own).
    Raises :class:`~shared.ids.InvalidInput` naming the variables when they are unusable."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from shared.servicemain import settings_errors, settings_from
    from shared.settings import ServiceSettings

    try:
        settings = settings_from(ServiceSettings)
    except (ValidationError, SettingsError) as exc:  # SettingsError: VTM_LOG that is no JSON
        raise InvalidInput(f"invalid settings:\n{settings_errors(exc, ServiceSettings)}") \
            from None
    return security_options(settings)


NO_ENV_PREFIX: Final[str] = "="
"""An environment prefix no variable name can start with (a name holds no ``=``): settings
made with it read their keyword arguments only, every other field keeps its default."""


def env_nats_security_options(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """:func:`security_options` of the ``VTM_NATS_*`` credentials and TLS variables
    (:data:`SECURITY_FIELDS`) of ``environ`` (None: this process's environment), checked as
    a service checks them (one way to authenticate, readable files) -- and of nothing else.

    For the tools that connect with ``--nats`` (``tap``, ``status``, ``replay --nats``): they
    read no other setting, so another one that is invalid (``VTM_LOG__LEVEL=verbose``, a group
    such as ``VTM_LOG`` that is no JSON) is no concern of theirs -- it is the service's that
    reads it, which refuses it when it starts -- and an error from them here would be reported
    as a security setting's. ``VTM_NATS_URL`` is not read either: the tool's URL is its
    ``--nats``. Raises :class:`~shared.ids.InvalidInput` naming the variables when these are
    unusable (:func:`env_security_options` validates the whole settings instead, for ``up``,
    whose children read them all)."""
    from pydantic import ValidationError

    from shared.servicemain import settings_errors
    from shared.settings import ServiceSettings

    env = os.environ if environ is None else environ
    # Names as pydantic-settings matches them (ServiceSettings is not case-sensitive).
    given = {name.lower()[len("vtm_"):]: value for name, value in env.items()
             if name.lower().startswith("vtm_")
             and name.lower()[len("vtm_"):] in SECURITY_FIELDS}
    try:
        # The values picked above only, each validated as the service would validate it.
        settings = ServiceSettings(_env_prefix=NO_ENV_PREFIX, **given)
    except ValidationError as exc:
        raise InvalidInput(f"invalid settings:\n{settings_errors(exc, ServiceSettings)}") \
            from None
    return security_options(settings)


__all__ = ["SECURITY_FIELDS", "env_nats_security_options", "env_security_options",
           "security_options", "tls_context"]
