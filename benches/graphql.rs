//! Time to cost one GraphQL query (parse and walk), for small, medium and large
//! documents, without and with a schema.
//!
//! `cargo bench --bench graphql --features graphql`

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use tollgate::cost::graphql::GraphqlCost;

const SDL: &str = r#"
    type Query { viewer: User repositories(first: Int): RepositoryConnection @listSize(slicingArguments: ["first"], sizedFields: ["nodes"]) }
    type User { login: String name: String avatarUrl: String }
    type RepositoryConnection { totalCount: Int nodes: [Repository] }
    type Repository { name: String owner: User issues(first: Int): IssueConnection @listSize(slicingArguments: ["first"], sizedFields: ["nodes"]) }
    type IssueConnection { totalCount: Int nodes: [Issue] }
    type Issue { title: String author: User }
"#;

fn documents() -> Vec<(&'static str, String)> {
    let small = "{ viewer { login } }".to_owned();
    let medium = r#"
        query Dashboard($n: Int = 20) {
          viewer { ...UserFields }
          repositories(first: $n) {
            totalCount
            nodes {
              name
              owner { ...UserFields }
              issues(first: 10) { totalCount nodes { title author { ...UserFields } } }
            }
          }
        }
        fragment UserFields on User { login name avatarUrl }
    "#
    .to_owned();
    // About 10 KB: 200 aliased copies of a nested selection.
    let large = format!(
        "{{ {} }}",
        (0..200)
            .map(|i| format!(
                "r{i}: repositories(first: 5) {{ nodes {{ name owner {{ login }} }} }} "
            ))
            .collect::<String>()
    );
    vec![("small", small), ("medium", medium), ("large", large)]
}

fn cost(c: &mut Criterion) {
    let plain = GraphqlCost::new();
    let schema = GraphqlCost::new().with_schema(SDL).unwrap();
    let mut group = c.benchmark_group("graphql_cost");
    for (size, document) in documents() {
        assert!(plain.query_cost(&document, None, None).is_ok(), "{size}");
        group.bench_with_input(
            BenchmarkId::new("no_schema", size),
            &document,
            |b, document| b.iter(|| black_box(plain.query_cost(document, None, None).unwrap())),
        );
        group.bench_with_input(
            BenchmarkId::new("schema", size),
            &document,
            |b, document| b.iter(|| black_box(schema.query_cost(document, None, None).unwrap())),
        );
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30);
    targets = cost
}
criterion_main!(benches);
