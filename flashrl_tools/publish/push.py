"""`publish(...)`: one Hub commit holding the config, its profiles and a model card."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flashrl_tools.publish.bundle import Bundle, build_bundle
from flashrl_tools.config.hub_errors import hub_errors, missing_token


@dataclass(frozen=True)
class PublishResult:
    bundle: Bundle
    commit: str | None  # None for a dry run
    revision: str

    @property
    def line(self) -> str:
        return self.bundle.line(self.commit)


def publish(config: Path, repo_id: str, *, path_in_repo: str = "", private: bool = False,
            revision: str | None = None, token: str | None = None, model_repo: str | None = None,
            dry_run: bool = False) -> PublishResult:
    bundle = build_bundle(config, repo_id, path_in_repo, model_repo)
    branch = revision or "main"
    if dry_run:
        return PublishResult(bundle, None, branch)

    from huggingface_hub import CommitOperationAdd, HfApi, get_token

    token = token or get_token()
    if not token:
        raise missing_token(repo_id)
    api = HfApi(token=token)
    ops = [CommitOperationAdd(u.path_in_repo, u.data) for u in bundle.uploads]
    with hub_errors("publishing", f"{repo_id}@{branch}"):
        api.create_repo(repo_id, private=private, exist_ok=True)
        if branch != "main":
            api.create_branch(repo_id, branch=branch, exist_ok=True)
        info = api.create_commit(repo_id, ops, revision=branch,
                                 commit_message=f"flashrl publish {bundle.config_path}",
                                 commit_description=f"{len(bundle.config.configs)} config entr"
                                                    f"{'y' if len(bundle.config.configs) == 1 else 'ies'}, "
                                                    f"{len(bundle.uploads) - 2} profile file(s)")
    return PublishResult(bundle, info.oid, branch)
