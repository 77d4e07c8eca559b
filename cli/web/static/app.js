// ckpt serve: sortable and filterable tables, the lineage graph's search and run panels.
// Served by the app itself; reads only the page it runs in (no requests, no innerHTML).
"use strict";

function cellValue(td, numeric) {
  const v = td.hasAttribute("data-v") ? td.getAttribute("data-v") : td.textContent.trim();
  if (!numeric) return v.toLowerCase();
  const x = parseFloat(v);
  return Number.isNaN(x) ? null : x;
}

function makeSortable(table) {
  const heads = table.querySelectorAll("thead th");
  heads.forEach((th, col) => {
    th.addEventListener("click", () => {
      const numeric = th.dataset.type === "num";
      const asc = !th.classList.contains("asc");
      heads.forEach((h) => h.classList.remove("asc", "desc"));
      th.classList.add(asc ? "asc" : "desc");
      const body = table.tBodies[0];
      const rows = Array.from(body.rows);
      rows.sort((r1, r2) => {
        const a = cellValue(r1.cells[col], numeric), b = cellValue(r2.cells[col], numeric);
        if (a === null && b === null) return 0;
        if (a === null) return 1;  // empty cells last, either way
        if (b === null) return -1;
        const c = a < b ? -1 : a > b ? 1 : 0;
        return asc ? c : -c;
      });
      rows.forEach((r) => body.appendChild(r));
    });
  });
}

function makeFilter(input) {
  const table = document.getElementById(input.dataset.filter);
  if (!table) return;
  const apply = () => {
    const q = input.value.trim().toLowerCase();
    for (const row of table.tBodies[0].rows) {
      row.hidden = q !== "" && !row.textContent.toLowerCase().includes(q);
    }
  };
  input.addEventListener("input", apply);
  apply();
}

// Edges touching the given node ids stand out, the others fade (none given: all normal).
function lightEdges(ids) {
  for (const e of document.querySelectorAll("#lineage .edge, #lineage .edge-label")) {
    const on = ids !== null && (ids.has(e.dataset.source) || ids.has(e.dataset.target));
    e.classList.toggle("hot", on);
    e.classList.toggle("faint", ids !== null && !on);
  }
}

function graphSearch(input) {
  const nodes = Array.from(document.querySelectorAll("#lineage .node"));
  const apply = () => {
    const q = input.value.trim().toLowerCase();
    let first = null;
    const hits = new Set();
    for (const n of nodes) {
      const text = (n.dataset.label + " " + n.dataset.refs).toLowerCase();
      const hit = q !== "" && text.includes(q);
      n.classList.toggle("dim", q !== "" && !hit);
      n.classList.toggle("hit", hit);
      if (hit) hits.add(n.dataset.id);
      if (hit && first === null) first = n;
    }
    lightEdges(q === "" ? null : hits);
    return first;
  };
  for (const n of nodes) {  // hovering a node shows what it was made from and what was made from it
    n.addEventListener("mouseenter", () => lightEdges(new Set([n.dataset.id])));
    n.addEventListener("mouseleave", apply);
  }
  input.addEventListener("input", apply);
  input.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter") {
      const first = apply();
      if (first) first.scrollIntoView({block: "center", inline: "center"});
    }
  });
}

function runPanels() {
  document.querySelectorAll("#lineage .expand").forEach((a) => {
    a.addEventListener("click", (ev) => {
      ev.preventDefault();
      const panel = document.getElementById("run-" + a.dataset.run);
      if (!panel) return;
      panel.open = !panel.open;
      if (panel.open) panel.scrollIntoView({block: "nearest"});
    });
  });
}

function autoSubmit(form) {
  form.querySelectorAll("select").forEach((s) => s.addEventListener("change", () => {
    const a = form.querySelector("#sel-a").value, b = form.querySelector("#sel-b").value;
    if (a && b) form.submit();
  }));
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("table.sortable").forEach(makeSortable);
  document.querySelectorAll("input[data-filter]").forEach(makeFilter);
  const gs = document.getElementById("graph-filter");
  if (gs) { graphSearch(gs); runPanels(); }
  const df = document.getElementById("diff-form");
  if (df) autoSubmit(df);
});
