//! README tables are specifications (each broker's wire format, the capability table): tests
//! read them from the Markdown, so the documentation cannot drift from the code unnoticed.

/// The first table under the line `heading` (e.g. `"## Wire format"`), up to the next heading:
/// the header row first, the `|---|` separator left out, each cell trimmed (backticks kept).
///
/// # Panics
/// When the heading or a table under it is missing, or a row has a different number of cells
/// than the header: the documentation is broken, which is what the calling test is for.
pub fn markdown_table(text: &str, heading: &str) -> Vec<Vec<String>> {
    let mut lines = text.lines().skip_while(|l| l.trim_end() != heading);
    assert!(lines.next().is_some(), "no {heading:?} section");
    let level = heading.chars().take_while(|c| *c == '#').count();
    let rows: Vec<Vec<String>> = lines
        .take_while(|l| !(l.starts_with('#') && l.chars().take_while(|c| *c == '#').count() <= level))
        .skip_while(|l| !l.trim_start().starts_with('|'))
        .take_while(|l| l.trim_start().starts_with('|'))
        .filter(|l| {
            let t = l.trim().trim_matches('|');
            !(t.contains('-') && t.chars().all(|c| matches!(c, '-' | ':' | '|' | ' ')))
        })
        .map(|l| l.trim().trim_matches('|').split('|').map(|c| c.trim().to_string()).collect())
        .collect();
    assert!(rows.len() > 1, "the table under {heading:?} has no rows");
    for r in &rows[1..] {
        assert_eq!(r.len(), rows[0].len(), "row {r:?} under {heading:?} does not have {} cells", rows[0].len());
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::markdown_table;

    #[test]
    fn reads_the_first_table_of_the_section_only() {
        let md = "# t\n## A\ntext\n\n| x | `y` |\n|---|---|\n| 1 | `2` |\n\n| other | table |\n## B\n| no | |\n";
        assert_eq!(markdown_table(md, "## A"), vec![vec!["x", "`y`"], vec!["1", "`2`"]]);
    }
}
