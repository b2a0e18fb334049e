"""mkdocs hooks: let the guides in docs/ link to repository files outside it, checked.

The guides link to ``../benchmarks/RESULTS.md`` and ``../recipes/*.yaml`` with paths that work on
any Git host and in a checkout. mkdocs only knows files under ``docs_dir``, so strict mode would call
those links broken. ``on_files`` adds each such target that exists in the repository to the build
(Markdown rendered as a page, anything else copied) under ``repo/``; a link to a file that does not
exist is left alone, and mkdocs' own link check fails the strict build on it. ``on_config`` makes
heading ids GitHub's, so that ``RESULTS.md#section`` anchors work both there and in the site, and
mkdocs' anchor check (``validation.anchors``) checks them.
"""

from __future__ import annotations

import posixpath
import re
import unicodedata
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files, InclusionLevel

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def github_slug(value: str, separator: str = "-") -> str:
    """GitHub's heading id: lowercase, punctuation dropped, each space a hyphen (not collapsed)."""
    value = unicodedata.normalize("NFKC", value).strip().lower()
    value = re.sub(r"[^\w\- ]", "", value)
    return value.replace(" ", separator)


def on_config(config: Any) -> Any:
    if "toc" not in config.markdown_extensions:
        config.markdown_extensions.append("toc")
    config.mdx_configs.setdefault("toc", {})["slugify"] = github_slug
    return config


def _outside_targets(file: File) -> list[str]:
    """src_uris (``../...``) of relative links in ``file`` that leave docs_dir."""
    text = _FENCE.sub("", file.content_string)
    out = []
    for url in _LINK.findall(text):
        path = url.split("#", 1)[0]
        if not path or re.match(r"^[a-z][a-z0-9+.-]*:", path) or path.startswith("/"):
            continue
        uri = posixpath.normpath(posixpath.join(posixpath.dirname(file.src_uri), path))
        if uri.startswith("../"):
            out.append(uri)
    return out


def on_files(files: Files, config: Any) -> Files:
    docs = Path(config.docs_dir).resolve()
    repo = docs.parent
    queue = [f for f in files if f.is_documentation_page()]
    seen: set[str] = set()
    while queue:
        for uri in _outside_targets(queue.pop()):
            if uri in seen:
                continue
            seen.add(uri)
            target = (docs / uri).resolve()
            if not target.is_file() or not target.is_relative_to(repo) or target.is_relative_to(docs):
                continue  # mkdocs reports the link as not found
            rel = target.relative_to(repo).as_posix()
            dest = "repo/" + rel
            if target.suffix == ".md":
                stem = posixpath.splitext(dest)[0]
                dest = stem + ("/index.html" if config.use_directory_urls else ".html")
            added = File(
                uri, str(docs), config.site_dir, config.use_directory_urls,
                dest_uri=dest, inclusion=InclusionLevel.INCLUDED,
            )
            files.append(added)
            if added.is_documentation_page():
                queue.append(added)
    return files
