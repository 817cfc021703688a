"""Hub failures -> one FlashRLError each (what, where, what to do), for publish and resolve alike."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from flashrl_tools.errors import FlashRLError


def _network_error(e: BaseException) -> bool:
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"ConnectError", "ConnectTimeout", "TimeoutException", "NetworkError",
                         "TransportError", "ConnectionError"})


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


@contextlib.contextmanager
def hub_errors(what: str, where: str) -> Iterator[None]:
    """`what`: the action ("publishing", "downloading config"); `where`: the repo/file it was for."""
    from huggingface_hub import errors as hf

    try:
        yield
    except FlashRLError:
        raise
    except hf.LocalTokenNotFoundError:
        raise missing_token(where) from None
    except (hf.LocalEntryNotFoundError, hf.OfflineModeIsEnabled):
        why = "HF_HUB_OFFLINE is set" if offline() else f"the Hub ({endpoint()}) could not be reached"
        raise FlashRLError(f"{what} failed: not in the local Hugging Face cache and {why}", where,
                           "run once with network access to fill the cache (HF_HOME / HF_HUB_CACHE), "
                           "or unset HF_HUB_OFFLINE") from None
    except hf.GatedRepoError:
        raise FlashRLError(f"{what} failed: the repo is gated", where,
                           "accept its terms on the Hub and pass a token (HF_TOKEN / --token)") from None
    except hf.RepositoryNotFoundError:
        raise FlashRLError(f"{what} failed: repo not found (or private and this token cannot see it)",
                           where, "check the USER/NAME spelling and that HF_TOKEN / --token may read it") from None
    except hf.RevisionNotFoundError:
        raise FlashRLError(f"{what} failed: revision not found", where,
                           "use an existing branch, tag or commit sha after '@'") from None
    except hf.EntryNotFoundError:
        raise FlashRLError(f"{what} failed: file not found in the repo", where,
                           "check the path inside the repo (and the revision)") from None
    except hf.HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status == 401:
            raise FlashRLError(f"{what} failed: the Hub rejected the token (401)", where,
                               "pass a valid token with --token or HF_TOKEN (`hf auth login`)") from None
        if status == 403:
            raise FlashRLError(f"{what} failed: permission denied (403)", where,
                               "use a token with access to this repo (write access to publish), or another repo") from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FlashRLError(f"{what} failed: Hub error ({first})", where) from None
    except Exception as e:
        if not _network_error(e):
            raise
        raise FlashRLError(f"{what} failed: cannot reach the Hub at {endpoint()} ({type(e).__name__})", where,
                           "check the network (and HF_ENDPOINT), or set HF_HUB_OFFLINE=1 to use the cache") from None


def missing_token(where: str) -> FlashRLError:
    return FlashRLError("no Hugging Face token", where,
                        "pass --token, set HF_TOKEN, or run `hf auth login`")
