//! `compare A.json B.json`: every figure the two results share, with B relative to A.

use std::path::Path;

use crate::report::{Report, Table, num};

/// Renders the comparison table of `before` and `after`.
pub fn compare(before: &Path, after: &Path) -> anyhow::Result<String> {
    let a = Report::read_json(before)?;
    let b = Report::read_json(after)?;
    let mut out = String::new();
    if a.scenario != b.scenario {
        out.push_str(&format!("  note: comparing different scenarios ({} vs {})\n", a.scenario, b.scenario));
    }
    let (fa, fb) = (a.flat(), b.flat());
    let mut table = Table::new(&["figure", "A", "B", "B/A"]);
    for (key, va) in &fa {
        let Some(vb) = fb.get(key) else { continue };
        let change = if *va == 0.0 { "-".to_owned() } else { format!("{:.3}", vb / va) };
        table.row(vec![key.clone(), num(*va), num(*vb), change]);
    }
    out.push_str(&format!("  A = {} ({}, load {:?})\n", before.display(), a.scenario, a.machine.load_average_start));
    out.push_str(&format!("  B = {} ({}, load {:?})\n", after.display(), b.scenario, b.machine.load_average_start));
    out.push_str(&table.render());
    let only: Vec<&String> =
        fa.keys().filter(|k| !fb.contains_key(*k)).chain(fb.keys().filter(|k| !fa.contains_key(*k))).collect();
    if !only.is_empty() {
        out.push_str(&format!(
            "  in one file only: {}\n",
            only.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
        ));
    }
    Ok(out)
}
