"""An mkdocs hook: links from docs/ to repository files outside it (``[bench/stats.py](../bench/stats.py)``).

Such a link works where the Markdown is read in the repository, but the site has no page for the file. On the
site it is rendered as the file's path, not as a link. A link to a file that does not exist in the repository
is left as it is, so mkdocs reports it as not found and ``mkdocs build --strict`` fails, as for a broken link
inside the site. Links within docs/, and their anchors, are left to mkdocs' own validation.
"""

from __future__ import annotations

import html
import os
import re
import xml.etree.ElementTree as etree
from typing import Any
from urllib.parse import unquote, urlsplit

from markdown import Extension, Markdown
from markdown.treeprocessors import Treeprocessor
from markdown.util import HTML_PLACEHOLDER

_current: dict[str, Any] = {}


def on_config(config: Any) -> Any:
    config.markdown_extensions.append(_RepoLinks(config))
    return config


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    _current["page"] = page  # the page whose Markdown is converted next
    return markdown


class _RepoLinks(Extension):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.docs_dir = os.path.realpath(config.docs_dir)
        self.repo_root = os.path.dirname(os.path.realpath(config.config_file_path))

    def extendMarkdown(self, md: Markdown) -> None:  # Python-Markdown's name
        md.treeprocessors.register(_RepoLinksProcessor(md, self), "devshim_repo_links", priority=10)  # before relpath


class _RepoLinksProcessor(Treeprocessor):
    def __init__(self, md: Markdown, ext: _RepoLinks) -> None:
        super().__init__(md)
        self.ext = ext

    def run(self, root: etree.Element) -> None:
        page = _current.get("page")
        if page is None:
            return
        page_dir = os.path.dirname(os.path.join(self.ext.docs_dir, page.file.src_path))
        for link in root.iter("a"):
            href = link.get("href", "")
            url = urlsplit(href)
            if url.scheme or url.netloc or not url.path or url.path.startswith("/"):
                continue
            target = os.path.normpath(os.path.join(page_dir, unquote(url.path)))
            if target == self.ext.docs_dir or target.startswith(self.ext.docs_dir + os.sep):
                continue  # a page or file of the site: mkdocs validates it
            repo_path = os.path.relpath(target, self.ext.repo_root)
            if repo_path.startswith(os.pardir) or not os.path.exists(target):
                continue  # left a link: mkdocs reports it as not found
            _unlink(link, repo_path.replace(os.sep, "/"), self._shown(link))

    def _shown(self, link: etree.Element) -> str:
        """The link's visible text, with inline code that an extension stashed away put back."""

        def stashed(match: re.Match[str]) -> str:
            block = self.md.htmlStash.rawHtmlBlocks[int(match.group(1))]
            raw = block if isinstance(block, str) else etree.tostring(block, encoding="unicode")
            return html.unescape(re.sub(r"<[^>]*>", "", raw))

        return _PLACEHOLDER.sub(stashed, "".join(link.itertext()))


_PLACEHOLDER = re.compile(HTML_PLACEHOLDER % r"(\d+)")


def _unlink(link: etree.Element, repo_path: str, shown: str) -> None:
    """The link becomes its text, followed by the path when the text does not show it."""
    link.tag = "span"
    link.attrib.clear()
    link.set("title", f"{repo_path} in the devshim repository")
    if repo_path.rstrip("/") not in shown:
        code = etree.SubElement(link, "code")
        code.text = repo_path
        last = link[-2] if len(link) > 1 else None
        if last is not None:
            last.tail = (last.tail or "") + " ("
        else:
            link.text = (link.text or "") + " ("
        code.tail = ")"
