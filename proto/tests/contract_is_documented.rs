//! Every message, enum, enum value, service, rpc and field of the contract
//! carries a comment: the `.proto` files are the API reference.

use std::path::Path;

fn is_declaration(line: &str) -> bool {
    let words: Vec<&str> = line.split_whitespace().collect();
    let Some(first) = words.first() else {
        return false;
    };
    match *first {
        "message" | "enum" | "service" | "rpc" => true,
        "syntax" | "package" | "import" | "oneof" | "option" | "}" | "//" => false,
        _ => line.contains('=') && line.trim_end().ends_with(';'),
    }
}

#[test]
fn every_declaration_has_a_comment() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tidepool/v1");
    let mut undocumented = Vec::new();
    let mut files = 0;
    for entry in std::fs::read_dir(&dir).expect("proto dir") {
        let path = entry.expect("dir entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("proto") {
            continue;
        }
        files += 1;
        let text = std::fs::read_to_string(&path).expect("read proto");
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let line = line.trim();
            if !is_declaration(line) {
                continue;
            }
            let previous = if i == 0 { "" } else { lines[i - 1].trim() };
            if !previous.starts_with("//") {
                undocumented.push(format!("{}:{}: {line}", path.display(), i + 1));
            }
        }
    }
    assert!(
        files >= 5,
        "expected the five v1 proto files, found {files}"
    );
    assert!(
        undocumented.is_empty(),
        "undocumented declarations:\n{}",
        undocumented.join("\n")
    );
}
