"""The API key as HTTP and gRPC read it: `Authorization: Bearer <key>`, the scheme in any case (RFC 7235 makes
auth schemes case-insensitive: `bearer KEY` is the same credential), the key compared in constant time."""

from __future__ import annotations

import hmac

SCHEME = b"bearer"


def api_key_matches(authorization: bytes | str, api_key: bytes) -> bool:
    given = authorization if isinstance(authorization, bytes) else authorization.encode()
    scheme, _, token = given.partition(b" ")
    # the scheme is public (the key is not): only the token's comparison must take the same time whatever it holds
    return hmac.compare_digest(scheme.lower(), SCHEME) & hmac.compare_digest(token.lstrip(b" "), api_key)
