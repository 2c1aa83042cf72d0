"""The command line's small blocking HTTP client of an agent's JSON API, and the admin token of
this device's cluster (what the admin commands send)."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from agent.core.errors import NcmError
from agent.local.config import ConfigError, load_config

HTTP_TIMEOUT_S = 10.0


def http_json(method: str, url: str, payload: Any = None, *, token: str | None = None,
              timeout_s: float = HTTP_TIMEOUT_S) -> Any:
    """A small blocking JSON call for the command line; errors become NcmError with the reason."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read()
    except urllib.error.HTTPError as error:
        try:
            message = json.loads(error.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = error.reason
        raise NcmError(f"{url}: HTTP {error.code}: {message}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise NcmError(f"cannot reach {url}: {reason}") from None
    except http.client.HTTPException as error:  # something answered that does not speak HTTP
        raise NcmError(f"{url} does not answer as an ncm agent (no HTTP: {type(error).__name__})") from None
    try:
        return json.loads(body or b"null")
    except ValueError:
        raise NcmError(f"{url} does not answer as an ncm agent (its answer is not JSON)") from None


def local_admin_token(config_path: Path | None = None, *, create: bool = False) -> str | None:
    """The admin token of this device's cluster key; None when this user cannot read it."""
    from agent.core.auth import admin_token
    from agent.node.service import cluster_key, stored_cluster_key

    try:
        config = load_config(config_path)
        key = cluster_key(config) if create else stored_cluster_key(config)
    except (ConfigError, OSError) as error:
        if create:
            raise NcmError(f"cannot read this device's cluster key: {error}") from None
        return None
    return admin_token(key) if key else None
