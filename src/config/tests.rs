use super::*;

fn parse(args: &[&str]) -> Options {
    let matches = Cli::command()
        .mut_args(|arg| arg.env(None))
        .get_matches_from(std::iter::once("seathold").chain(args.iter().copied()));
    let mut cli = Cli::from_arg_matches(&matches).expect("parses");
    cli.record_given(&matches);
    cli.serve
}

#[test]
fn settle_lowers_only_defaults_not_values_given_equal_to_them() {
    // Given equal to its default: refused, not lowered.
    let mut opts = parse(&[
        "--max-ttl-ms",
        "1800000",
        "--max-hold-lifetime-ms",
        "600000",
    ]);
    assert!(opts.given.contains("max_ttl_ms"), "{:?}", opts.given);
    opts.settle();
    assert_eq!(opts.max_ttl_ms, 1_800_000);
    assert!(opts.validate().is_err());
    // Left at its default: lowered, once.
    let mut opts = parse(&["--max-hold-lifetime-ms", "600000"]);
    opts.settle();
    assert_eq!(opts.max_ttl_ms, 600_000);
    assert!(opts.validate().is_ok());
    opts.max_hold_lifetime_ms = 1000;
    opts.settle();
    assert_eq!(opts.max_ttl_ms, 600_000, "a second settle does nothing");
}
