"""mkdocs hook: links from docs/ pages to repository files outside docs/ (results/, conf/, harness/, ...).

mkdocs resolves a relative link only among the files under docs/, so `../results/frontier/README.md` would be
"not found". For every such link whose target is a file of the repository, this hook adds that file to the build
as a static file, copied as it is to `repo/<its path>` in the site: the link then resolves on the site, and the same
Markdown reads correctly where the repository is browsed as files. A target that does not exist is not added, so
mkdocs reports the link as not found and `mkdocs build --strict` fails on it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

# An inline link or image target: ](target) or ](target "title"); code blocks are removed before the search.
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCED = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


class RepoFile(File):
    """A repository file outside docs/: copied into the site as it is, never rendered as a page."""

    def is_documentation_page(self) -> bool:
        return False


def outside_targets(markdown: str, src_uri: str) -> set[str]:
    """The link targets of one page (its path under docs/: `src_uri`) that leave docs/, as mkdocs resolves them
    (`../results/x.md`), without anchors or queries."""
    text = _CODE_SPAN.sub("", _FENCED.sub("", markdown))
    targets = set()
    for link in _LINK.findall(text):
        path = re.split(r"[#?]", link, maxsplit=1)[0]
        if not path or ":" in path or path.startswith("/"):
            continue  # an anchor alone, a URL (http:, mailto:) or an absolute link: mkdocs' own rules apply
        uri = posixpath.normpath(posixpath.join(posixpath.dirname(src_uri), path))
        if uri.startswith("../"):
            targets.add(uri)
    return targets


def on_files(files: Files, config) -> Files:
    docs = Path(config["docs_dir"]).resolve()
    root = docs.parent
    for page in list(files.documentation_pages()):
        for uri in sorted(outside_targets(Path(page.abs_src_path).read_text(encoding="utf-8"), page.src_uri)):
            source = (docs / uri).resolve()
            if (
                files.get_file_from_path(uri) is not None
                or not source.is_file()
                or root not in source.parents
            ):
                continue  # already added, or missing (mkdocs then reports the link), or outside the repository
            files.append(
                RepoFile(
                    uri,
                    str(docs),
                    config["site_dir"],
                    config["use_directory_urls"],
                    dest_uri=f"repo/{source.relative_to(root).as_posix()}",
                    inclusion=InclusionLevel.NOT_IN_NAV,
                )
            )
    return files
