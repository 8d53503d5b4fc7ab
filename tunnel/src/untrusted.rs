//! Text from the other side of the wire (agent ids, targets, header values), made safe to log:
//! only printable ASCII, and bounded.

/// `text` without control characters, spaces or non-ASCII, at most `max` characters.
pub fn printable(text: &str, max: usize) -> String {
    text.chars().filter(|c| c.is_ascii_graphic()).take(max).collect()
}

#[cfg(test)]
mod tests {
    use super::printable;

    #[test]
    fn only_printable_ascii_survives_and_length_is_bounded() {
        assert_eq!(printable("node-1\r\n\u{1b}[31mevil", 64), "node-1[31mevil");
        assert_eq!(printable("héllo wörld", 64), "hllowrld");
        assert_eq!(printable(&"x".repeat(1000), 32).len(), 32);
    }
}
