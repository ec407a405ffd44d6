"""Pieces shared by the HTML pages (plan report, run report): the inline stylesheet and tables.

No torch import.
"""

from __future__ import annotations

from html import escape

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;margin:24px auto;
max-width:1280px;color:#1d2329;padding:0 16px}
h1{font-size:22px;margin-bottom:2px}h2{font-size:17px;margin-top:30px;border-bottom:1px solid #ddd;padding-bottom:4px}
.sub{color:#555;margin-top:0}.pred{color:#7a4fa0;font-size:11px;font-weight:600;text-transform:uppercase;
letter-spacing:.04em}
table{border-collapse:collapse;margin:8px 0;font-size:13px}th,td{border:1px solid #ddd;padding:3px 8px;
text-align:left;vertical-align:top}th{background:#f3f5f7}td.n{text-align:right;font-variant-numeric:tabular-nums}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:12px 0}.card{border:1px solid #ddd;border-radius:6px;
padding:8px 12px;min-width:130px}.card b{display:block;font-size:18px}
pre{background:#f7f7f7;padding:8px;overflow-x:auto;font-size:12px}.note{color:#555;font-size:13px}
.bad{color:#c0392b}.figure{overflow-x:auto}
"""


def table(headers: list[str], rows: list[list[str]], numeric: set[int] | None = None) -> str:
    numeric = numeric or set()
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f'<td{" class=n" if i in numeric else ""}>{escape(str(c))}</td>'
                         for i, c in enumerate(r)) + "</tr>"
        for r in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
