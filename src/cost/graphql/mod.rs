//! The static cost of a GraphQL request, the way GitHub and Shopify charge points: a query
//! is charged what it could cost to answer, before it runs (feature `graphql`).
//!
//! Model (no schema): an object field (one with a selection set) costs 1, a scalar field 0
//! (1 under an alias: `a0: name a1: name ...` asks for one more value each);
//! a field with a slicing argument (`first`, `last`, `limit`) multiplies its children by
//! that argument; each root field is a resolver call and costs at least 1 (so does each
//! alias of one: `{ a: search b: search }` runs it twice), and each root field of a
//! mutation pays a base (10) on top (each alias one more mutation run); every alias
//! counts; fields of one response name are one call, as a server merges them; fragments and
//! inline fragments are expanded; the chosen `operationName` is costed; batched operations
//! are summed, and their number capped. Arithmetic saturates, so no document overflows.
//! A selection costs the same written inline, in an inline fragment or in a named one: a
//! list size reaches the fields it sizes through fragments of every kind.
//!
//! Hostile documents are bounded: the parser stops at a recursion and a token limit, a
//! fragment's cost is computed once for each type and list size it is spread under,
//! however often it is spread (no exponential blow-up), fragment cycles are refused,
//! slicing values outside 1..=100 (configurable) are refused or capped, and costing one
//! body takes at most 100,000 field visits (configurable).
//!
//! ```
//! use tollgate::cost::graphql::GraphqlCost;
//!
//! let coster = GraphqlCost::new();
//! let query = "{ viewer { repositories(first: 50) { nodes { name issues(first: 10) { totalCount } } } } }";
//! // viewer 1 + repositories (1 + 50 x (nodes 1 + issues (1 + 10 x 0)))
//! assert_eq!(coster.query_cost(query, None, None)?, 1 + 1 + 50 * (1 + 1));
//! # Ok::<(), tollgate::cost::graphql::CostError>(())
//! ```

mod json;
mod layer;
mod schema;

pub use layer::{GRAPHQL_COST, GraphqlCostLayer, GraphqlCostService, Invalid};

/// The deepest nesting [`GraphqlCost::max_depth`] may allow: parsing and costing recurse
/// once a level, and a document nested 800 levels overflowed a 2 MiB stack (a Tokio
/// worker's) in a debug build, aborting the process. At this bound the deepest document is
/// refused on such a stack.
pub const MAX_DEPTH: usize = 200;

/// What a list the schema declares is assumed to hold when nothing sizes it (see
/// [`GraphqlCost::list_size`]).
const DEFAULT_LIST_SIZE: u64 = 10;

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;

use apollo_compiler::ast::{self, Definition, OperationType, Selection, Value};
use serde_json::{Map, Value as Json};

/// What to do with a slicing value outside the allowed range (or missing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OutOfRange {
    /// Refuse the request with a clear error (GitHub's behaviour).
    #[default]
    Reject,
    /// Charge as if the largest allowed value was given: for a value above the range,
    /// below it (many servers read a negative or zero limit as no limit at all), or
    /// missing. Choose it only when the server clamps slicing values to the same range
    /// (or refuses them): a value it runs as given is charged only the cap.
    ///
    /// ```
    /// use tollgate::cost::graphql::{CostError, GraphqlCost, OutOfRange};
    ///
    /// let capped = GraphqlCost::new().slice_range(1, 100, OutOfRange::Cap);
    /// // Charged as 100 whether 5000, 0 or -1 is asked for: repos 1 + 100 x nodes 1.
    /// for first in ["5000", "0", "-1"] {
    ///     let query = format!("{{ repos(first: {first}) {{ nodes {{ id }} }} }}");
    ///     assert_eq!(capped.query_cost(&query, None, None)?, 101);
    /// }
    /// // Within the range, as given.
    /// assert_eq!(capped.query_cost("{ repos(first: 7) { nodes { id } } }", None, None)?, 8);
    ///
    /// // The default refuses it.
    /// assert!(matches!(
    ///     GraphqlCost::new().query_cost("{ repos(first: 5000) { nodes { id } } }", None, None),
    ///     Err(CostError::Slicing { value: Some(5000), min: 1, max: 100, .. })
    /// ));
    /// # Ok::<(), CostError>(())
    /// ```
    Cap,
}

/// Why a request could not be costed. Malformed requests are the client's fault: the layer
/// answers them with `400` and the message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CostError {
    /// The body is not a GraphQL request (bad JSON, no `query`).
    Request(String),
    /// The document does not parse (or hits the parser's recursion or token limit).
    Parse(String),
    /// No operation to run: none named so, or several and no `operationName`.
    Operation(String),
    /// A fragment spreads itself, directly or through others.
    FragmentCycle(String),
    /// A fragment is spread but not defined.
    UnknownFragment(String),
    /// A slicing argument is missing or out of range.
    Slicing {
        /// The field.
        field: String,
        /// The argument.
        argument: String,
        /// The value given (`None`: missing).
        value: Option<i64>,
        /// The allowed range.
        min: u64,
        /// The allowed range.
        max: u64,
    },
    /// More operations in one batch than allowed.
    Batch {
        /// Operations sent.
        count: usize,
        /// The most allowed.
        max: usize,
    },
    /// Nesting deeper than allowed.
    TooDeep {
        /// The most allowed.
        max: usize,
    },
    /// Costing the body would take more field visits than allowed
    /// ([`GraphqlCost::max_field_visits`]): a selection set is walked once for each type
    /// it may be on, and each argument of a field is a visit, so a document through an
    /// interface of many types asks for many.
    TooComplex {
        /// The most allowed.
        max: u64,
    },
    /// An introspection query that multiplies: one list of an introspection type (a
    /// type's `fields`, `inputFields`, `interfaces`, `possibleTypes`, `enumValues`) inside
    /// another on one path, a field under an alias inside introspection (`a: types`,
    /// `b: types`), or the whole schema (`__schema`) asked for more than once.
    /// No schema sizes these lists, so such a document would be work that multiplies at
    /// each level for a charge that adds one; the introspection query tools send goes
    /// through each at most once on a path.
    Introspection(String),
}

impl fmt::Display for CostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CostError::Request(why) => write!(f, "not a GraphQL request: {why}"),
            CostError::Parse(why) => write!(f, "the GraphQL document does not parse: {why}"),
            CostError::Operation(why) => f.write_str(why),
            CostError::FragmentCycle(name) => write!(f, "fragment {name} spreads itself"),
            CostError::UnknownFragment(name) => write!(f, "fragment {name} is not defined"),
            CostError::Slicing {
                field,
                argument,
                value: Some(value),
                min,
                max,
            } => write!(
                f,
                "{field}({argument}: {value}) is out of range: {argument} must be between {min} and {max}"
            ),
            CostError::Slicing {
                field,
                argument,
                min,
                max,
                ..
            } => write!(f, "{field} needs {argument} between {min} and {max}"),
            CostError::Batch { count, max } => {
                write!(f, "{count} operations in one batch, at most {max} allowed")
            }
            CostError::TooDeep { max } => write!(f, "the document nests deeper than {max} levels"),
            CostError::TooComplex { max } => write!(
                f,
                "costing the document takes more than {max} field visits (each field, and \
                 each of its arguments, once for each type it may be on)"
            ),
            CostError::Introspection(why) => write!(
                f,
                "an introspection query that multiplies is refused: {why}"
            ),
        }
    }
}

impl std::error::Error for CostError {}

/// The cost model and its limits.
#[derive(Debug, Clone)]
pub struct GraphqlCost {
    slicing_arguments: Vec<String>,
    mutation_base: u64,
    min_cost: u64,
    min_slice: u64,
    max_slice: u64,
    out_of_range: OutOfRange,
    max_batch: usize,
    max_depth: usize,
    token_limit: usize,
    max_field_visits: u64,
    list_size: u64,
    schema: Option<std::sync::Arc<schema::Schema>>,
}

/// Why a request went uncosted, as the layer weighs it. `refused`: the coster read the
/// request and refused it, for a limit of the model (a list size out of range, a batch
/// too large, nesting too deep, a document too long or too costly to cost) or because a
/// server may read it otherwise than the coster did (a key in two spellings). The server
/// would run such a request, so no fixed charge ([`Invalid::Charge`]) stands in for its
/// cost. Otherwise the request could not be read (it does not parse, it is a persisted
/// query's hash), and the server will say so in its own words.
#[derive(Debug)]
pub(super) struct Uncosted {
    pub(super) error: CostError,
    pub(super) refused: bool,
    /// What the rest of a batch costs, and how many of its entries went uncosted: a
    /// fixed charge stands in for each of those, not for the whole batch.
    pub(super) costed: u64,
    pub(super) uncosted: u64,
}

impl From<CostError> for Uncosted {
    fn from(error: CostError) -> Self {
        let refused = matches!(
            error,
            CostError::Slicing { .. }
                | CostError::Batch { .. }
                | CostError::TooDeep { .. }
                | CostError::TooComplex { .. }
                | CostError::Introspection(_)
        );
        Self {
            error,
            refused,
            costed: 0,
            uncosted: 1,
        }
    }
}

impl Uncosted {
    /// Read and refused, whatever the error says.
    pub(super) fn refused(error: CostError) -> Self {
        Self {
            refused: true,
            ..Self::from(error)
        }
    }

    /// A request read and refused for `why` (a malformed or ambiguous one).
    pub(super) fn refused_request(why: impl Into<String>) -> Self {
        Self::refused(CostError::Request(why.into()))
    }

    /// What a fixed charge of `charge` for each uncosted entry comes to.
    pub(super) fn charged(&self, charge: u64) -> u64 {
        self.costed
            .saturating_add(charge.saturating_mul(self.uncosted))
    }
}

impl Default for GraphqlCost {
    fn default() -> Self {
        Self::new()
    }
}

impl GraphqlCost {
    /// Slicing arguments `first`, `last`, `limit` in 1..=100 (else refused), 10 for each
    /// root field of a mutation, every root field at least 1, batches of at most 10, nesting of at most 64
    /// levels, documents of at most 20,000 tokens, at most 100,000 field visits a body,
    /// and (with a schema) 10 items in a list nothing sizes ([`list_size`](Self::list_size)).
    pub fn new() -> Self {
        Self {
            slicing_arguments: ["first", "last", "limit"].map(String::from).to_vec(),
            mutation_base: 10,
            min_cost: 1,
            min_slice: 1,
            max_slice: 100,
            out_of_range: OutOfRange::Reject,
            max_batch: 10,
            max_depth: 64,
            token_limit: 20_000,
            max_field_visits: 100_000,
            list_size: DEFAULT_LIST_SIZE,
            schema: None,
        }
    }

    /// Costs with a schema (SDL): field types decide what is an object (weight 1) and
    /// what a leaf (0); `@cost(weight:)` on types and fields and `@listSize(assumedSize:,
    /// slicingArguments:, sizedFields:, requireOneSlicingArgument:)` on fields are
    /// honoured; a selection on an interface or union costs its most expensive member.
    /// A directive argument of another shape than the directive takes
    /// (`slicingArguments: [first]` where `["first"]` is meant, `"true"` for a Boolean),
    /// or one it does not take (`@cost(weigth:)`), is an error, naming the field: read
    /// leniently it would be dropped, and a slicing argument with it.
    ///
    /// ```
    /// use tollgate::cost::graphql::GraphqlCost;
    ///
    /// let sdl = r#"
    ///   type Query { repos(first: Int): RepoConnection @listSize(slicingArguments: ["first"], sizedFields: ["nodes"]) }
    ///   type RepoConnection { nodes: [Repo] totalCount: Int }
    ///   type Repo { name: String owner: User @cost(weight: 5) }
    ///   type User { login: String }
    /// "#;
    /// let coster = GraphqlCost::new().with_schema(sdl)?;
    /// // repos 1 + 10 x (nodes: repo 1 + owner 5)
    /// assert_eq!(coster.query_cost("{ repos(first: 10) { totalCount nodes { name owner { login } } } }", None, None)?, 1 + 10 * (1 + 5));
    /// # Ok::<(), tollgate::cost::graphql::CostError>(())
    /// ```
    pub fn with_schema(mut self, sdl: &str) -> Result<Self, CostError> {
        self.schema = Some(std::sync::Arc::new(schema::Schema::parse(sdl)?));
        Ok(self)
    }

    /// The argument names that size a list (default `first`, `last`, `limit`). The list
    /// replaces the default one: a name left out no longer sizes a list.
    ///
    /// ```
    /// use tollgate::cost::graphql::GraphqlCost;
    ///
    /// let coster = GraphqlCost::new().slicing_arguments(["take", "pageSize"]);
    /// // repos 1 + 20 x nodes 1
    /// assert_eq!(coster.query_cost("{ repos(take: 20) { nodes { id } } }", None, None)?, 21);
    /// assert_eq!(coster.query_cost("{ repos(pageSize: 30) { nodes { id } } }", None, None)?, 31);
    /// // `first` is an argument like any other now: repos 1 + nodes 1.
    /// assert_eq!(coster.query_cost("{ repos(first: 20) { nodes { id } } }", None, None)?, 2);
    /// # Ok::<(), tollgate::cost::graphql::CostError>(())
    /// ```
    pub fn slicing_arguments<I: IntoIterator<Item = S>, S: Into<String>>(
        mut self,
        names: I,
    ) -> Self {
        self.slicing_arguments = names.into_iter().map(Into::into).collect();
        self
    }

    /// The base cost of each root field of a mutation (default 10): each is a mutation
    /// run, and so is each alias of one.
    ///
    /// ```
    /// use tollgate::cost::graphql::GraphqlCost;
    ///
    /// let coster = GraphqlCost::new();
    /// assert_eq!(coster.query_cost("mutation { send(to: 1) }", None, None)?, 10);
    /// assert_eq!(coster.query_cost("mutation { a: send(to: 1) b: send(to: 2) }", None, None)?, 20);
    /// # Ok::<(), tollgate::cost::graphql::CostError>(())
    /// ```
    pub fn mutation_base(mut self, cost: u64) -> Self {
        self.mutation_base = cost;
        self
    }

    /// The least each root field of an operation costs (default 1): leaves cost nothing,
    /// and a cost of 0 spends nothing, so a query of scalar fields alone would otherwise
    /// run unlimited, and a root field is a resolver call whatever it returns (each alias
    /// one more). Each root field is charged at least this, whatever the others cost
    /// (fields of one response name are one call); each operation of a batch on its own.
    ///
    /// ```
    /// use tollgate::cost::graphql::GraphqlCost;
    ///
    /// assert_eq!(GraphqlCost::new().query_cost("{ hello }", None, None)?, 1);
    /// assert_eq!(GraphqlCost::new().query_cost("{ a: hello b: hello }", None, None)?, 2);
    /// // A connection of 10 (1 + 10) and one more resolver call.
    /// let query = "{ repos(first: 10) { nodes { name } } hello }";
    /// assert_eq!(GraphqlCost::new().query_cost(query, None, None)?, 12);
    /// assert_eq!(GraphqlCost::new().min_cost(0).query_cost("{ hello }", None, None)?, 0);
    /// # Ok::<(), tollgate::cost::graphql::CostError>(())
    /// ```
    pub fn min_cost(mut self, cost: u64) -> Self {
        self.min_cost = cost;
        self
    }

    /// The allowed slicing values (default 1..=100) and what to do outside them. A
    /// document writes integers of at most 64 bits, signed: a bound above `i64::MAX`
    /// (`u64::MAX` for "no cap") is `i64::MAX`.
    ///
    /// ```
    /// use tollgate::cost::graphql::{GraphqlCost, OutOfRange};
    ///
    /// let uncapped = GraphqlCost::new().slice_range(1, u64::MAX, OutOfRange::Reject);
    /// assert_eq!(uncapped.query_cost("{ repos(first: 5000) { nodes { id } } }", None, None)?, 1 + 5000);
    /// # Ok::<(), tollgate::cost::graphql::CostError>(())
    /// ```
    pub fn slice_range(mut self, min: u64, max: u64, out_of_range: OutOfRange) -> Self {
        let (min, max) = (min.min(i64::MAX as u64), max.min(i64::MAX as u64));
        self.min_slice = min.min(max);
        self.max_slice = max.max(min);
        self.out_of_range = out_of_range;
        self
    }

    /// What a list the schema declares is assumed to hold when nothing in the query or
    /// the schema sizes it (default 10): no slicing argument given or defaulted, no
    /// `@listSize(assumedSize:)`. Such a list (`users: [User!]!`, or a field
    /// `sizedFields` names) is charged as this many items, so that nesting lists the
    /// client cannot be made to page (`{ users { friends { friends { name } } } }`)
    /// multiplies the cost as it multiplies the server's work. Set it to the most items
    /// such a list returns (your server's default page size), or size the lists in the
    /// schema (`@listSize(assumedSize:)`, or `slicingArguments` with
    /// `requireOneSlicingArgument`). Without a schema no field is known to be a list:
    /// each costs as one item unless a slicing argument sizes it.
    ///
    /// ```
    /// use tollgate::cost::graphql::GraphqlCost;
    ///
    /// let sdl = "type Query { users: [User!]! } type User { name: String friends: [User!]! }";
    /// let coster = GraphqlCost::new().with_schema(sdl)?;
    /// // users 1 + 10 x (friends 1 + 10 x (friends 1))
    /// let deep = "{ users { friends { friends { name } } } }";
    /// assert_eq!(coster.query_cost(deep, None, None)?, 1 + 10 * (1 + 10));
    /// assert_eq!(coster.list_size(3).query_cost(deep, None, None)?, 1 + 3 * (1 + 3));
    /// # Ok::<(), tollgate::cost::graphql::CostError>(())
    /// ```
    pub fn list_size(mut self, size: u64) -> Self {
        self.list_size = size;
        self
    }

    /// The most operations in one batched request (default 10). A batch is a JSON array
    /// of requests; their costs are summed.
    ///
    /// ```
    /// use tollgate::cost::graphql::{CostError, GraphqlCost};
    ///
    /// let coster = GraphqlCost::new().max_batch(2);
    /// let two = br#"[{"query":"{ a { b } }"}, {"query":"{ c(first: 5) { d { e } } }"}]"#;
    /// assert_eq!(coster.json_cost(two)?, 1 + (1 + 5));
    /// let three = br#"[{"query":"{ a }"}, {"query":"{ a }"}, {"query":"{ a }"}]"#;
    /// assert_eq!(coster.json_cost(three), Err(CostError::Batch { count: 3, max: 2 }));
    /// # Ok::<(), CostError>(())
    /// ```
    pub fn max_batch(mut self, max: usize) -> Self {
        self.max_batch = max;
        self
    }

    /// The most visits costing one body may take (default 100,000; a batch shares them),
    /// past which it is refused with [`CostError::TooComplex`]. Each selection (a field, a
    /// fragment spread, an inline fragment) is visited once for each type its selection
    /// set is costed on, each argument of a field once with it (a field of 3 arguments is
    /// 4 visits), and each possible type of an interface or a union once: a
    /// document at the token limit, through an interface of 300 types, would take millions
    /// before the limiter has a say.
    ///
    /// ```
    /// use tollgate::cost::graphql::{CostError, GraphqlCost};
    ///
    /// let coster = GraphqlCost::new().max_field_visits(3);
    /// assert_eq!(coster.query_cost("{ a { b c } }", None, None)?, 1);
    /// assert!(matches!(
    ///     coster.query_cost("{ a { b c d } }", None, None),
    ///     Err(CostError::TooComplex { max: 3 })
    /// ));
    /// // An argument is a visit.
    /// assert_eq!(coster.query_cost("{ a(first: 2) { b } }", None, None)?, 1);
    /// assert!(matches!(
    ///     coster.query_cost(r#"{ a(first: 2, after: "x") { b } }"#, None, None),
    ///     Err(CostError::TooComplex { max: 3 })
    /// ));
    /// # Ok::<(), CostError>(())
    /// ```
    pub fn max_field_visits(mut self, max: u64) -> Self {
        self.max_field_visits = max;
        self
    }

    /// The deepest nesting accepted (default 64). Each field is a level, and so is each
    /// fragment (an inline one, or a named one where it is spread): a chain of fragments
    /// is bounded as a chain of fields is, and the walk's stack with it. So a query
    /// that wraps every level of fields in a fragment reaches the bound at half as many
    /// levels of fields; raise it for such queries, up to [`MAX_DEPTH`].
    ///
    /// # Panics
    ///
    /// Above [`MAX_DEPTH`]: a hostile document that deep would overflow the stack while
    /// it is read, aborting the process.
    ///
    /// ```
    /// use tollgate::cost::graphql::{CostError, GraphqlCost};
    ///
    /// let inline = "{ a { b { c } } }";
    /// let wrapped = "{ ... on Query { a { ... on A { b { c } } } } }";
    /// assert!(GraphqlCost::new().max_depth(3).query_cost(inline, None, None).is_ok());
    /// assert!(matches!(
    ///     GraphqlCost::new().max_depth(3).query_cost(wrapped, None, None),
    ///     Err(CostError::TooDeep { max: 3 })
    /// ));
    /// # Ok::<(), CostError>(())
    /// ```
    pub fn max_depth(mut self, max: usize) -> Self {
        assert!(
            max <= MAX_DEPTH,
            "GraphqlCost::max_depth({max}) is above MAX_DEPTH ({MAX_DEPTH}): a document that \
             deep would overflow the stack while it is read"
        );
        self.max_depth = max.max(1);
        self
    }

    /// The cost of one operation: `query`, the operation to run, and its variables (as
    /// the `serde_json` map a GraphQL server holds them in: a third-party type in this
    /// signature on purpose, since variables are JSON).
    pub fn query_cost(
        &self,
        query: &str,
        operation_name: Option<&str>,
        variables: Option<&Map<String, Json>>,
    ) -> Result<u64, CostError> {
        self.costing(query, operation_name, variables)
            .map_err(|uncosted| uncosted.error)
    }

    /// [`GraphqlCost::query_cost`], and how the layer weighs an error.
    pub(super) fn costing(
        &self,
        query: &str,
        operation_name: Option<&str>,
        variables: Option<&Map<String, Json>>,
    ) -> Result<u64, Uncosted> {
        let mut visits = self.max_field_visits;
        self.costing_within(query, operation_name, variables, &mut visits)
    }

    /// [`GraphqlCost::costing`] within `visits` field visits, what is left of them left
    /// there (the operations of a batch share them).
    fn costing_within(
        &self,
        query: &str,
        operation_name: Option<&str>,
        variables: Option<&Map<String, Json>>,
        visits: &mut u64,
    ) -> Result<u64, Uncosted> {
        let recursion_limit = self.max_depth.saturating_mul(2);
        let mut parser = apollo_compiler::parser::Parser::new()
            .recursion_limit(recursion_limit)
            .token_limit(self.token_limit);
        let document = match parser.parse_ast(query, "request.graphql") {
            Ok(document) => document,
            Err(invalid) => {
                // The first error's message only: rendering every error with its source
                // costs time quadratic in a hostile document full of errors.
                let error = CostError::Parse(match invalid.errors.iter().next() {
                    Some(first) => format!("Error: {}", first.error),
                    None => "invalid document".to_owned(),
                });
                // A document past a limit of the parser is one a server would run; so may
                // be one this parser refuses where others take it.
                let limited = parser.tokens_reached() > self.token_limit
                    || parser.recursion_reached() > recursion_limit;
                return Err(if limited || others_may_parse(query) {
                    Uncosted::refused(error)
                } else {
                    error.into()
                });
            }
        };
        let mut operations = Vec::new();
        let mut fragments = HashMap::new();
        for definition in &document.definitions {
            match definition {
                Definition::OperationDefinition(operation) => operations.push(operation),
                Definition::FragmentDefinition(fragment) => {
                    // Servers that validate refuse it; one that does not runs either.
                    let twice = fragments.insert(fragment.name.as_str(), fragment).is_some();
                    if twice {
                        return Err(Uncosted::refused(CostError::Operation(format!(
                            "fragment {} is defined twice",
                            fragment.name
                        ))));
                    }
                }
                _ => {}
            }
        }
        // An empty name names no operation: gqlgen runs the only one for it.
        let operation = match operation_name.filter(|name| !name.is_empty()) {
            Some(name) => operations
                .iter()
                .find(|operation| operation.name.as_deref() == Some(name))
                .ok_or_else(|| CostError::Operation(format!("no operation named {name}")))?,
            None => match operations.as_slice() {
                [only] => only,
                [] => {
                    return Err(CostError::Operation("the document has no operation".into()).into());
                }
                // Refused whatever `on_invalid` says: graphql-java runs the first
                // operation for an empty name, so no fixed charge stands in for it.
                _ => {
                    return Err(Uncosted::refused(CostError::Operation(
                        "several operations and no operationName".into(),
                    )));
                }
            },
        };
        // A variable defined twice may be read with either definition's default (servers
        // that validate refuse it): refused, as a JSON name given twice is.
        let mut definitions = HashMap::with_capacity(operation.variables.len());
        for definition in &operation.variables {
            if definitions
                .insert(definition.name.as_str(), &**definition)
                .is_some()
            {
                return Err(Uncosted::refused(CostError::Operation(format!(
                    "the variable ${} is defined twice",
                    definition.name
                ))));
            }
        }
        let schema = self.schema.as_deref();
        let root = schema.and_then(|schema| {
            let slot = match operation.operation_type {
                OperationType::Query => "query",
                OperationType::Mutation => "mutation",
                OperationType::Subscription => "subscription",
            };
            schema.roots.get(slot).map(String::as_str)
        });
        let mut walk = Walk {
            model: self,
            schema,
            fragments,
            root_costs: HashMap::new(),
            done: HashMap::new(),
            costed: HashMap::new(),
            visiting: Vec::new(),
            deepest: 0,
            definitions,
            variables,
            visits: *visits,
            introspection: None,
            whole_schema: false,
            in_field: false,
            sized_by_name: false,
            below_sized: false,
            introspected: false,
        };
        // A mutation's root field pays its base on top: the minimum less that.
        let root_floor = match operation.operation_type {
            OperationType::Mutation => self.min_cost.saturating_sub(self.mutation_base),
            OperationType::Query | OperationType::Subscription => self.min_cost,
        };
        let cost = walk
            .selections(&operation.selection_set, root, None, 0)
            .map(|below| {
                (walk.root_costs.values())
                    .fold(below, |sum, &cost| sum.saturating_add(cost.max(root_floor)))
            });
        *visits = walk.visits;
        // Each root field is a resolver call: at least the minimum each (the walk
        // charged it so), and for a mutation its base each (an alias is one more
        // mutation run). Counted once the walk took the document (no cycle, within the
        // depth), and bounded by the depth too.
        let calls = if cost.is_ok() {
            root_fields(&operation.selection_set, &walk.fragments, self.max_depth).max(1)
        } else {
            1
        };
        let cost = cost.map_err(|error| match error {
            // The walk's one request error: a field given two slicing arguments where its
            // `@listSize` requires one; a server that does not read the directive runs
            // the rest of the document.
            CostError::Request(_) => Uncosted::refused(error),
            error => error.into(),
        })?;
        let cost = match operation.operation_type {
            OperationType::Mutation => {
                cost.saturating_add(self.mutation_base.saturating_mul(calls))
            }
            OperationType::Query | OperationType::Subscription => cost,
        };
        Ok(cost.max(self.min_cost.saturating_mul(calls)))
    }

    /// The cost of a JSON request body: one request object, or an array of them (a
    /// batch: summed). An object anywhere in it that holds a name twice is an error
    /// (servers differ on which of the two they read).
    ///
    /// ```
    /// use tollgate::cost::graphql::GraphqlCost;
    ///
    /// let coster = GraphqlCost::new();
    /// assert_eq!(coster.json_cost(br#"{"query":"{ a(first: 5) { b { c } } }"}"#)?, 6);
    /// let twice = br#"{"query":"{ a(first: 5) { b { c } } }","query":"{ a }"}"#;
    /// assert!(coster.json_cost(twice).is_err());
    /// # Ok::<(), tollgate::cost::graphql::CostError>(())
    /// ```
    pub fn json_cost(&self, body: &[u8]) -> Result<u64, CostError> {
        self.json_costing(body).map_err(|uncosted| uncosted.error)
    }

    /// [`GraphqlCost::json_cost`], and how the layer weighs an error.
    pub(super) fn json_costing(&self, body: &[u8]) -> Result<u64, Uncosted> {
        // A body that is not JSON to the coster may be to a server (Go's decoder stops
        // after the first value, JavaScript takes a lone surrogate): refused, not charged.
        let body = without_bom(body);
        // A name twice in one object is refused too: which of the two a server reads is
        // its own (see `json`).
        let json = json::parse(body)
            .map_err(|error| Uncosted::refused(CostError::Request(error.to_string())))?;
        let mut visits = self.max_field_visits;
        match json {
            Json::Array(batch) => {
                if batch.len() > self.max_batch {
                    return Err(CostError::Batch {
                        count: batch.len(),
                        max: self.max_batch,
                    }
                    .into());
                }
                // An empty batch runs nothing, and would cost nothing: not a request.
                if batch.is_empty() {
                    return Err(CostError::Request("an empty batch".into()).into());
                }
                // Every entry is read: one refused refuses the batch, and a fixed charge
                // stands in for each entry that went uncosted, the others costing what
                // they cost.
                let (mut costed, mut uncosted, mut first) = (0u64, 0u64, None);
                for request in &batch {
                    match self.request_cost(request, &mut visits) {
                        Ok(cost) => costed = costed.saturating_add(cost),
                        Err(error) if error.refused => return Err(error),
                        Err(error) => {
                            uncosted += 1;
                            first.get_or_insert(error);
                        }
                    }
                }
                match first {
                    Some(first) => Err(Uncosted {
                        costed,
                        uncosted,
                        ..first
                    }),
                    None => Ok(costed),
                }
            }
            request => self.request_cost(&request, &mut visits),
        }
    }

    fn request_cost(&self, request: &Json, visits: &mut u64) -> Result<u64, Uncosted> {
        // A request malformed in its JSON is refused, not charged: what a server makes of it
        // (variables sent as a string, a number for a query) is its own.
        let malformed = Uncosted::refused_request;
        let object = request
            .as_object()
            .ok_or_else(|| malformed("expected an object with a query"))?;
        // Some servers match keys in any case (Go's JSON decoding).
        if let Some(key) = object.keys().find(|key| another_case_of_a_request_key(key)) {
            return Err(Uncosted::refused_request(format!(
                "{key:?} is a GraphQL request's key to a server that reads keys in any case"
            )));
        }
        // A server that supports persisted documents may run the stored one and ignore
        // the query: the query's cost would say nothing of what runs. `id` is a persisted
        // query's name too (Hot Chocolate, Relay), and so is `doc_id` (Relay's guide).
        if let Some(name) = PERSISTED_KEYS
            .into_iter()
            .find(|name| object.get(*name).is_some_and(|id| !id.is_null()))
        {
            let error = CostError::Request(format!(
                "a {name}: a persisted document cannot be costed, and a server may run \
                 it rather than the query (or the query rather than it)"
            ));
            // Beside a query: a server without persisted documents runs the query.
            return Err(match object.get("query") {
                None | Some(Json::Null) => error.into(),
                Some(_) => Uncosted::refused(error),
            });
        }
        let query = match object.get("query") {
            Some(Json::String(query)) => query,
            // A persisted query's hash without its document: nothing to cost.
            None | Some(Json::Null) => {
                return Err(CostError::Request("no query string".into()).into());
            }
            Some(_) => return Err(malformed("the query is not a string")),
        };
        let operation_name = match object.get("operationName") {
            None | Some(Json::Null) => None,
            Some(Json::String(name)) => Some(name.as_str()),
            Some(_) => return Err(malformed("operationName must be a string")),
        };
        let variables = match object.get("variables") {
            None | Some(Json::Null) => None,
            Some(Json::Object(variables)) => Some(variables),
            Some(_) => return Err(malformed("variables must be an object")),
        };
        self.costing_within(query, operation_name, variables, visits)
    }
}

/// True when `body` may be JSON (or a document's shorthand `{ ... }`) to a server that
/// decodes it by any charset: its first character that is not white space is `{` or `[`,
/// whatever the encoding (the NULs of UTF-16 and UTF-32 and any byte-order mark are
/// passed over). What follows is not read: Jackson (Spring's converter) reads the first
/// value and leaves the rest, decodes a lone surrogate as U+FFFD, and decodes by any
/// charset the body declares, so no stricter test holds for every server.
pub(super) fn looks_like_json(body: &[u8]) -> bool {
    body.iter()
        .copied()
        .find(|byte| {
            !matches!(
                byte,
                0 | b' ' | b'\t' | b'\r' | b'\n' | 0xef | 0xbb | 0xbf | 0xfe | 0xff
            )
        })
        .is_some_and(|byte| byte == b'{' || byte == b'[')
}

/// `body` without a leading byte order mark, which body parsers skip.
pub(super) fn without_bom(body: &[u8]) -> &[u8] {
    body.strip_prefix(b"\xef\xbb\xbf").unwrap_or(body)
}

/// True when a document this coster's parser refused may be one other parsers take:
/// a surrogate escape (`\uD800`: gqlparser, gqlgen's, writes a lone one as it is), or a
/// string before an operation or a fragment (a description on an operation, which
/// graphql-js and graphql-java take since 2025). Such a document is refused, not charged:
/// the server may run it.
fn others_may_parse(document: &str) -> bool {
    let surrogate = document.as_bytes().windows(4).any(|window| {
        window[0] == b'\\'
            && window[1] == b'u'
            && (window[2] == b'{'
                || (window[2].eq_ignore_ascii_case(&b'd')
                    && matches!(window[3].to_ascii_lowercase(), b'8'..=b'9' | b'a'..=b'f')))
    });
    surrogate || described(document).0 || document.starts_with('\u{feff}')
}

/// True when a string in `document` is followed, past what a document ignores, by what a
/// description describes (graphql-spec's executable descriptions: on operations,
/// fragments and variables); and how many bytes the search stepped over.
///
/// Ignored are spaces, tabs, line terminators (`\n`, `\r`), commas, byte order marks and
/// comments (`#` to the line's end). Each quote starts a search, and one that enters a
/// comment the search before it stepped over ends where that one did (from there on
/// it is the same path): the searches step over each byte a bounded number of times, so
/// a document of quotes and comments (`"#"#"#...`) costs time linear in its length.
fn described(document: &str) -> (bool, usize) {
    const STARTS: [&str; 6] = ["query", "mutation", "subscription", "fragment", "$", "{"];
    let bytes = document.as_bytes();
    let mut steps = 0usize;
    // The last search that stepped over a comment: from its first comment to where it
    // ended.
    let mut last: Option<(usize, usize)> = None;
    for (at, _) in document.match_indices('"') {
        let mut i = at + 1;
        let mut first_comment = None;
        let end = loop {
            while i < bytes.len() {
                match bytes[i] {
                    b' ' | b'\t' | b'\n' | b'\r' | b',' => i += 1,
                    0xEF if bytes[i..].starts_with(b"\xEF\xBB\xBF") => i += 3,
                    _ => break,
                }
                steps += 1;
            }
            if bytes.get(i) != Some(&b'#') {
                break i;
            }
            if let Some((from, to)) = last
                && from <= i
                && i < to
            {
                first_comment = None;
                break to;
            }
            first_comment.get_or_insert(i);
            while i < bytes.len() && bytes[i] != b'\n' && bytes[i] != b'\r' {
                i += 1;
                steps += 1;
            }
        };
        if let Some(from) = first_comment {
            last = Some((from, end));
        }
        // `end` is after ASCII bytes or a whole mark: a character boundary.
        let rest = &document[end..];
        if STARTS.iter().any(|start| rest.starts_with(start)) {
            return (true, steps);
        }
    }
    (false, steps)
}

/// How many resolver calls the root of `selections` makes: its fields' distinct response
/// names (an alias is a call of its own; one name written twice, or spread twice through a
/// fragment, is merged into one call), through fragments of every kind, at most
/// `max_depth` fragments deep (the walk refuses deeper); `__typename` calls none. Each
/// fragment is read once, so the count takes time linear in the document.
fn root_fields(
    selections: &[Selection],
    fragments: &HashMap<&str, &apollo_compiler::Node<ast::FragmentDefinition>>,
    max_depth: usize,
) -> u64 {
    use std::collections::HashSet;
    fn collect<'a>(
        selections: &'a [Selection],
        fragments: &HashMap<&str, &'a apollo_compiler::Node<ast::FragmentDefinition>>,
        spread: &mut HashSet<&'a str>,
        names: &mut HashSet<&'a str>,
        depth: usize,
    ) {
        for selection in selections {
            match selection {
                Selection::Field(field) if field.name == "__typename" => {}
                Selection::Field(field) => {
                    names.insert(field.alias.as_ref().unwrap_or(&field.name).as_str());
                }
                _ if depth == 0 => {}
                Selection::InlineFragment(fragment) => {
                    collect(&fragment.selection_set, fragments, spread, names, depth - 1);
                }
                Selection::FragmentSpread(name) => {
                    let name = name.fragment_name.as_str();
                    // Each fragment once: spread again, its fields merge with its own.
                    if spread.insert(name)
                        && let Some(fragment) = fragments.get(name)
                    {
                        collect(&fragment.selection_set, fragments, spread, names, depth - 1);
                    }
                }
            }
        }
    }
    let mut names = HashSet::new();
    collect(
        selections,
        fragments,
        &mut HashSet::new(),
        &mut names,
        max_depth,
    );
    names.len() as u64
}

/// The keys of a GraphQL request, in a JSON body or a URL, as the coster spells them.
const REQUEST_KEYS: [&str; 7] = [
    "query",
    "variables",
    "operationName",
    "extensions",
    "documentId",
    "id",
    "doc_id",
];

/// The keys that name a persisted document a server may run instead of a `query`.
const PERSISTED_KEYS: [&str; 3] = ["documentId", "id", "doc_id"];

/// True when `name` is a request key to a server that reads keys in any case (Go's JSON
/// decoding, ASP.NET Core's query collection) but is not spelt as one: such a server
/// takes it for that key, which the coster did not read.
fn another_case_of_a_request_key(name: &str) -> bool {
    REQUEST_KEYS
        .iter()
        .any(|known| *known != name && same_to_a_server(name, known))
}

/// The name a PHP or Rack (before 3) server files a URL or form parameter under: PHP reads
/// a name to its first NUL, skips leading spaces and makes `.` and ` ` in it `_`; Rack
/// strips brackets around it; both read `name[...]` as a list or a map under `name`
/// (`[query]`, ` query`, `query]`, `query[x]` and `query%00x` are all `query` there, and
/// `doc.id` is `doc_id`).
pub(super) fn filed_under(name: &str) -> Cow<'_, str> {
    let name = name.split('\0').next().unwrap_or(name);
    let name = name.trim_start_matches([' ', '[', ']']);
    let name = name.split(['[', ']']).next().unwrap_or(name);
    if name.contains(['.', ' ']) {
        name.replace(['.', ' '], "_").into()
    } else {
        name.into()
    }
}

/// True when a URL or form parameter named `name` is a request key to some server, but not
/// spelt as the coster reads one: in another case (`QUERY`), or a name PHP or Rack files
/// under a key (`[query]`, ` query`, `query[x]`).
pub(super) fn another_spelling_of_a_request_key(name: &str) -> bool {
    let filed = filed_under(name);
    another_case_of_a_request_key(name)
        || (filed != name
            && REQUEST_KEYS
                .iter()
                .any(|known| same_to_a_server(&filed, known)))
}

/// True when a server that compares names without regard to case may read `name` as
/// `known` (an ASCII name): ASCII letters in either case, and the letters whose other
/// case is an ASCII one under Unicode's rules, which Go's `EqualFold` (`ſ` for `s`, `K`
/// for `k`), Java's `equalsIgnoreCase` and .NET's `OrdinalIgnoreCase` (`ı` and `İ` for
/// `i`) apply.
pub(super) fn same_to_a_server(name: &str, known: &str) -> bool {
    if name.is_ascii() {
        return name.eq_ignore_ascii_case(known);
    }
    let mut folded = name.chars().map(|c| {
        c.to_lowercase()
            .chain(c.to_uppercase())
            .find(char::is_ascii_alphabetic)
            .map_or(c, |ascii| ascii.to_ascii_lowercase())
    });
    known
        .chars()
        .all(|k| folded.next() == Some(k.to_ascii_lowercase()))
        && folded.next().is_none()
}

/// One costing pass over one operation.
struct Walk<'a> {
    model: &'a GraphqlCost,
    schema: Option<&'a schema::Schema>,
    fragments: HashMap<&'a str, &'a apollo_compiler::Node<ast::FragmentDefinition>>,
    /// Fragments already costed, per concrete type and list size (the same fragment spread
    /// in a connection of 2 and in one of 100 costs differently): each is costed once per
    /// such context, however often it is spread, so fragment fan-out cannot explode.
    /// With each, how many levels its walk went below the spread: a fragment costed
    /// already still counts its depth where it is spread again.
    done: HashMap<Memo<'a>, (u64, usize)>,
    /// Selection sets already costed on one of several possible types (of an interface
    /// or a union), likewise per concrete type and list size, with how many levels their
    /// walk went below them (see [`Walk::on_possible_types`]).
    costed: HashMap<Costed<'a>, (u64, usize)>,
    visiting: Vec<&'a str>,
    /// The deepest level reached so far.
    deepest: usize,
    /// The operation's variable definitions by name: a document may define thousands, and
    /// each visit of a field may look one up for each of its slicing arguments.
    definitions: HashMap<&'a str, &'a ast::VariableDefinition>,
    variables: Option<&'a Map<String, Json>>,
    /// Field visits left ([`GraphqlCost::max_field_visits`]).
    visits: u64,
    /// Inside an introspection field (`__schema`, `__type`): whether the path went
    /// through a list of an introspection type (see [`CostError::Introspection`]).
    introspection: Option<bool>,
    /// Whether a `__schema` field was costed.
    whole_schema: bool,
    /// Set inside a field's selection set (below the root), where an aliased leaf costs.
    in_field: bool,
    /// The field being costed is one a connection's `sizedFields` names: the
    /// connection's size stands for it, so its own list is not sized again.
    sized_by_name: bool,
    /// The field being costed is directly below a field that is no list but is sized (a
    /// connection's `first` without `sizedFields`): if it is a list, that size stands for
    /// it. (A connection of its own there is not: its lists are a level further down.)
    below_sized: bool,
    /// The root fields' costs by response name (the fields of one name, a server's one
    /// call, summed: their selections merge), each charged at least `min_cost` once the
    /// walk is over (a resolver call, whatever the others cost; in a mutation, whose root
    /// fields each pay its base on top, the minimum less the base). `__typename` runs no
    /// resolver.
    root_costs: HashMap<&'a str, u64>,
    /// Set when the walk went into an introspection field: a cost remembered for a
    /// fragment or a selection set that holds one does not stand for a spread elsewhere,
    /// where the path above differs.
    introspected: bool,
}

/// The lists of `__Type`, each of them values that lead to more types.
const TYPE_LISTS: [&str; 5] = [
    "fields",
    "inputFields",
    "interfaces",
    "possibleTypes",
    "enumValues",
];

/// A fragment in a context: its name, the concrete type and the list size it is costed in,
/// and whether it is spread below the root (where its aliased leaves cost).
type Memo<'a> = (&'a str, Option<String>, Option<Sizing<'a>>, bool);

/// A selection set of the document (where it is, and its length) in a context: the
/// concrete type and the list size it is costed in, and whether it is below the root.
type Costed<'a> = (usize, usize, String, Option<Sizing<'a>>, bool);

/// A list size that applies only to some child fields (`@listSize(sizedFields:)`): the
/// context a connection's selection set is costed in, and the fragments spread in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Sizing<'s> {
    /// The fields the size multiplies (`nodes`, `edges`), from the schema.
    fields: &'s [String],
    size: u64,
    /// Every list directly below is sized already: the field above is no list and its
    /// size (a slicing argument, an assumed size) multiplies its whole selection, as a
    /// connection's `first` does without `sizedFields`.
    lists: bool,
}

impl<'a> Walk<'a> {
    /// The cost of `selections` on a value of type `parent`, in the list-size context
    /// `sized`: with a schema and an abstract parent, the most expensive of its possible
    /// types.
    fn selections(
        &mut self,
        selections: &'a [Selection],
        parent: Option<&str>,
        sized: Option<Sizing<'a>>,
        depth: usize,
    ) -> Result<u64, CostError> {
        match (self.schema, parent) {
            (Some(schema), Some(parent)) => {
                self.on_possible_types(schema, selections, parent, sized, depth)
            }
            _ => self.selections_on(selections, None, sized, depth),
        }
    }

    /// The cost of `selections` on a value of type `ty` (with a schema): the most
    /// expensive of its possible types. On each of several (an interface's, a union's) it
    /// is memoised per (selection set, type, size), as fragments are: each possible type
    /// walks the selection sets below again, so without this a query through an interface
    /// that leads back to itself would be walked once per path through the types above,
    /// 2^levels times.
    fn on_possible_types(
        &mut self,
        schema: &schema::Schema,
        selections: &'a [Selection],
        ty: &str,
        sized: Option<Sizing<'a>>,
        depth: usize,
    ) -> Result<u64, CostError> {
        let possible = schema.possible(ty);
        if let [concrete] = &*possible {
            return self.selections_on(selections, Some(concrete), sized, depth);
        }
        let mut most = 0;
        for concrete in possible.iter() {
            self.visit()?;
            let memo = (
                selections.as_ptr() as usize,
                selections.len(),
                concrete.clone(),
                sized,
                self.in_field,
            );
            let cost = match self.costed.get(&memo) {
                Some(&costed) => self.recall(costed, depth)?,
                None => {
                    let outer = std::mem::take(&mut self.introspected);
                    let (cost, below) = self.measured(depth, |walk| {
                        walk.selections_on(selections, Some(&memo.2), sized, depth)
                    });
                    let cost = cost?;
                    if !self.introspected {
                        self.costed.insert(memo, (cost, below));
                    }
                    self.introspected |= outer;
                    cost
                }
            };
            most = most.max(cost);
        }
        Ok(most)
    }

    /// The cost of `selections` on an object of type `concrete` (unknown without schema).
    fn selections_on(
        &mut self,
        selections: &'a [Selection],
        concrete: Option<&str>,
        sized: Option<Sizing<'a>>,
        depth: usize,
    ) -> Result<u64, CostError> {
        self.reach(depth)?;
        let mut total = 0u64;
        for selection in selections {
            self.visit()?;
            let cost = match selection {
                Selection::Field(field) => {
                    // Each argument is read at each visit (for slicing, and the variable
                    // it names): a visit each, or a leaf of thousands of them, reached
                    // again and again, is work the bound does not see.
                    self.visits_for(field.arguments.len())?;
                    let in_field = std::mem::replace(&mut self.in_field, true);
                    self.sized_by_name = sized.is_some_and(|sized| {
                        sized.fields.iter().any(|name| name == field.name.as_str())
                    });
                    self.below_sized = sized.is_some_and(|sized| sized.lists);
                    let cost = self.field(field, concrete, depth);
                    self.in_field = in_field;
                    let mut cost = cost?;
                    // A leaf is free under its own name; each alias of one below the root
                    // is one more value resolved and sent (5,000 of them under two lists
                    // of 100 ask for 50 million): 1 at least. (A root field's aliases
                    // are resolver calls, charged as such.)
                    if in_field
                        && field.selection_set.is_empty()
                        && field
                            .alias
                            .as_ref()
                            .is_some_and(|alias| *alias != field.name)
                    {
                        cost = cost.max(1);
                    }
                    let cost = match sized {
                        Some(sized)
                            if sized.fields.iter().any(|name| name == field.name.as_str()) =>
                        {
                            cost.saturating_mul(sized.size)
                        }
                        _ => cost,
                    };
                    if in_field {
                        cost
                    } else {
                        // A root field: counted by its response name (see `root_costs`).
                        if field.name != "__typename" {
                            let name = field.alias.as_ref().unwrap_or(&field.name).as_str();
                            let counted = self.root_costs.entry(name).or_default();
                            *counted = counted.saturating_add(cost);
                        }
                        0
                    }
                }
                Selection::InlineFragment(fragment) => {
                    let applies = match (self.schema, concrete, &fragment.type_condition) {
                        (Some(schema), Some(concrete), Some(condition)) => {
                            schema.matches(concrete, condition)
                        }
                        _ => true,
                    };
                    if applies {
                        self.selections_on(&fragment.selection_set, concrete, sized, depth + 1)?
                    } else {
                        0
                    }
                }
                Selection::FragmentSpread(spread) => {
                    self.fragment(spread.fragment_name.as_str(), concrete, sized, depth)?
                }
            };
            total = total.saturating_add(cost);
        }
        Ok(total)
    }

    fn field(
        &mut self,
        field: &'a ast::Field,
        concrete: Option<&str>,
        depth: usize,
    ) -> Result<u64, CostError> {
        if field.name == "__typename" {
            return Ok(0);
        }
        let name = field.name.as_str();
        // Under another name an introspection list is asked for twice (`a: types`, `b:
        // types`): tools never do.
        if self.introspection.is_some() && field.alias.is_some() {
            return Err(CostError::Introspection(format!(
                "{name} under an alias inside an introspection field"
            )));
        }
        let inside = match self.introspection {
            Some(true) if TYPE_LISTS.contains(&name) => {
                return Err(CostError::Introspection(format!(
                    "{name} inside another list of an introspection type"
                )));
            }
            Some(false) if TYPE_LISTS.contains(&name) => true,
            Some(_) => return self.field_cost(field, concrete, depth),
            None if name == "__schema" || name == "__type" => {
                if name == "__schema" {
                    // Once an operation (wherever it is: a field that returns the query
                    // type reaches it too). Fragments that reach it are walked at each
                    // spread, so each is seen.
                    if self.whole_schema {
                        return Err(CostError::Introspection(
                            "__schema asked for more than once".to_owned(),
                        ));
                    }
                    self.whole_schema = true;
                }
                self.introspected = true;
                false
            }
            None => return self.field_cost(field, concrete, depth),
        };
        let outer = self.introspection.replace(inside);
        let cost = self.field_cost(field, concrete, depth);
        self.introspection = outer;
        cost
    }

    fn field_cost(
        &mut self,
        field: &'a ast::Field,
        concrete: Option<&str>,
        depth: usize,
    ) -> Result<u64, CostError> {
        let info = match (self.schema, concrete) {
            (Some(schema), Some(concrete)) => schema.field(concrete, field.name.as_str()),
            _ => None,
        };
        let Some((schema, info)) = self.schema.zip(info) else {
            // No schema (or an unknown field): objects 1, leaves 0, slicing multiplies.
            if field.selection_set.is_empty() {
                // A leaf costs nothing. Without a schema nothing tells a list of them
                // from one value, and the slicing range holds on both.
                self.slice(field, &self.model.slicing_arguments, None, false)?;
                return Ok(0);
            }
            let children = self.selections(&field.selection_set, None, None, depth + 1)?;
            let size = self
                .slice(field, &self.model.slicing_arguments, None, false)?
                .unwrap_or(1);
            return Ok(1u64.saturating_add(size.saturating_mul(children)));
        };
        let composite = schema.kind(&info.ty) == schema::Kind::Composite;
        let declared = schema.types.get(&info.ty).and_then(|ty| ty.weight);
        let type_weight = declared.unwrap_or(u64::from(composite));
        // A type's own `@cost` is what each of its values costs: on a list, each item's
        // (a field's own `@cost` is the call's, once). A type without one costs its
        // default once a field, as a list of objects costs 1 without a schema.
        let (called, each) = match (info.list, declared) {
            (true, Some(each)) => (info.weight.unwrap_or(0), each),
            _ => (info.weight.unwrap_or(type_weight), 0),
        };
        // `@cost` on the arguments given adds to the field's.
        let weight = info
            .argument_weights
            .iter()
            .fold(called, |weight, (argument, extra)| {
                if field
                    .arguments
                    .iter()
                    .any(|given| given.name == argument.as_str())
                {
                    weight.saturating_add(*extra)
                } else {
                    weight
                }
            });
        if field.selection_set.is_empty() && !info.list && info.list_size.is_none() {
            // One leaf value: its arguments size nothing.
            return Ok(weight);
        }
        // What a list nothing sizes is assumed to hold: a list the schema declares (or
        // the lists `sizedFields` names), not an object.
        let sized_by_name = std::mem::take(&mut self.sized_by_name);
        let below_sized = std::mem::take(&mut self.below_sized);
        let sized_by_parent = sized_by_name || (below_sized && info.list);
        let unsized_size = if !sized_by_parent
            && (info.list
                || info
                    .list_size
                    .as_ref()
                    .is_some_and(|list| !list.sized_fields.is_empty()))
        {
            self.model.list_size
        } else {
            1
        };
        let given = match &info.list_size {
            Some(list) if list.slicing_written => self
                .slice(
                    field,
                    &list.slicing_arguments,
                    Some(&info.defaults),
                    list.require_one,
                )?
                .or(list.assumed_size),
            // A size with no slicing arguments written (`assumedSize`, `sizedFields`
            // alone) is what a list is assumed to hold when nothing sizes it: the model's
            // `first`, `last` and `limit` still do when the query gives them, range
            // checked (a `first: 100000` the server honours is not charged the assumed
            // 20). The schema's defaults for them do not: the assumed size stands in for
            // those. (`slicingArguments: []` says no argument sizes the list.)
            Some(list) => self
                .slice(field, &self.model.slicing_arguments, None, false)?
                .or(list.assumed_size),
            None => self.slice(
                field,
                &self.model.slicing_arguments,
                Some(&info.defaults),
                false,
            )?,
        };
        let size = given.unwrap_or(unsized_size);
        if field.selection_set.is_empty() {
            // A list of leaves costs its weight once (each item's when its type has
            // one), and its slicing range holds.
            return Ok(weight.saturating_add(size.saturating_mul(each)));
        }
        let ty = info.ty.as_str();
        let sized_fields = info
            .list_size
            .as_ref()
            .map_or(&[][..], |list| list.sized_fields.as_slice());
        if sized_fields.is_empty() {
            // No list, sized all the same (a connection's `first` without `sizedFields`):
            // its size stands for the lists it holds (`nodes`, `edges`), not sized again.
            let below = (!info.list && given.is_some()).then_some(Sizing {
                fields: &[],
                size: 1,
                lists: true,
            });
            let children = self.selections(&field.selection_set, Some(ty), below, depth + 1)?;
            Ok(weight.saturating_add(size.saturating_mul(each.saturating_add(children))))
        } else {
            // A connection: the size applies to its sized fields (`nodes`, `edges`),
            // wherever they are selected: directly, or in a fragment of either kind.
            let sized = Sizing {
                fields: sized_fields,
                size,
                lists: false,
            };
            let most =
                self.on_possible_types(schema, &field.selection_set, ty, Some(sized), depth + 1)?;
            Ok(weight.saturating_add(each).saturating_add(most))
        }
    }

    /// The cost of a fragment spread on an object of type `concrete`, in the list-size
    /// context of the selection set it is spread in: memoised per (fragment, type, size).
    fn fragment(
        &mut self,
        name: &'a str,
        concrete: Option<&str>,
        sized: Option<Sizing<'a>>,
        depth: usize,
    ) -> Result<u64, CostError> {
        let memo = (name, concrete.map(str::to_owned), sized, self.in_field);
        // Inside an introspection field what a fragment may hold depends on the path
        // above it: walked again at each spread (field visits still bound the work).
        let remember = self.introspection.is_none();
        if remember && let Some(&done) = self.done.get(&memo) {
            return self.recall(done, depth);
        }
        if self.visiting.contains(&name) {
            return Err(CostError::FragmentCycle(name.to_owned()));
        }
        let fragment = *self
            .fragments
            .get(name)
            .ok_or_else(|| CostError::UnknownFragment(name.to_owned()))?;
        if let (Some(schema), Some(concrete)) = (self.schema, concrete)
            && !schema.matches(concrete, fragment.type_condition.as_str())
        {
            return Ok(0);
        }
        self.visiting.push(name);
        let outer = std::mem::take(&mut self.introspected);
        let (cost, below) = self.measured(depth, |walk| {
            walk.selections_on(&fragment.selection_set, concrete, sized, depth + 1)
        });
        self.visiting.pop();
        let cost = cost?;
        if remember && !self.introspected {
            self.done.insert(memo, (cost, below));
        }
        self.introspected |= outer;
        Ok(cost)
    }

    /// Runs `walk` from `depth` and says how many levels it went below `depth`, for a
    /// memo: a cost remembered still counts its depth where it is reached again.
    fn measured(
        &mut self,
        depth: usize,
        walk: impl FnOnce(&mut Self) -> Result<u64, CostError>,
    ) -> (Result<u64, CostError>, usize) {
        let outer = std::mem::replace(&mut self.deepest, depth);
        let cost = walk(self);
        let below = self.deepest - depth;
        self.deepest = self.deepest.max(outer);
        (cost, below)
    }

    /// A remembered cost and how far below it went ([`Walk::measured`]), reached again
    /// at `depth`.
    fn recall(&mut self, (cost, below): (u64, usize), depth: usize) -> Result<u64, CostError> {
        self.reach(depth.saturating_add(below))?;
        Ok(cost)
    }

    /// Counts one visit (a selection on one type, or one possible type of a selection
    /// set): past the model's bound, the document is too costly to cost.
    fn visit(&mut self) -> Result<(), CostError> {
        self.visits_for(1)
    }

    /// Counts `count` visits ([`Walk::visit`]).
    fn visits_for(&mut self, count: usize) -> Result<(), CostError> {
        self.visits = u64::try_from(count)
            .ok()
            .and_then(|count| self.visits.checked_sub(count))
            .ok_or(CostError::TooComplex {
                max: self.model.max_field_visits,
            })?;
        Ok(())
    }

    /// The operation's definition of the variable `name`.
    fn definition(&self, name: &str) -> Option<&'a ast::VariableDefinition> {
        self.definitions.get(name).copied()
    }

    /// Notes that the walk reached `depth`: past the model's limit, the document is too
    /// deep.
    fn reach(&mut self, depth: usize) -> Result<(), CostError> {
        if depth > self.model.max_depth {
            return Err(CostError::TooDeep {
                max: self.model.max_depth,
            });
        }
        self.deepest = self.deepest.max(depth);
        Ok(())
    }

    /// The list size a field's slicing arguments ask for: the largest of those given (a
    /// server may honour any of them), else of their defaults; `None` when it has none
    /// (and none is required). A field that requires one (`requireOneSlicingArgument`)
    /// takes exactly one.
    fn slice(
        &self,
        field: &ast::Field,
        names: &[String],
        defaults: Option<&HashMap<String, i64>>,
        required: bool,
    ) -> Result<Option<u64>, CostError> {
        let slicing = |name: &str| names.iter().any(|slicing| slicing == name);
        let mut given = 0;
        let mut largest = None;
        for argument in &field.arguments {
            if !slicing(argument.name.as_str()) {
                continue;
            }
            // A variable not given leaves the argument to the schema's default, where it
            // has one; where none is known, it is sized as a value missing (refused, or
            // the most under `OutOfRange::Cap`): the server's default may be no limit.
            let to_default = self.unset(&argument.value)
                && defaults.is_some_and(|defaults| defaults.contains_key(argument.name.as_str()));
            if !to_default {
                given += 1;
                let size = self.in_range(field, &argument.name, self.int(&argument.value))?;
                largest = largest.max(Some(size));
            }
        }
        if required && given > 1 {
            return Err(CostError::Request(format!(
                "{} takes exactly one of its slicing arguments ({}), not {given}",
                field.name,
                names.join(", ")
            )));
        }
        if given > 0 {
            return Ok(largest);
        }
        for name in names {
            if let Some(value) = defaults.and_then(|defaults| defaults.get(name)) {
                largest = largest.max(Some(self.in_range(field, name, Some(*value))?));
            }
        }
        match (largest, names.first()) {
            (Some(size), _) => Ok(Some(size)),
            (None, Some(name)) if required => self.in_range(field, name, None).map(Some),
            (None, _) => Ok(None),
        }
    }

    /// A slicing value within the model's range: as it is, capped, or refused.
    fn in_range(
        &self,
        field: &ast::Field,
        argument: &str,
        value: Option<i64>,
    ) -> Result<u64, CostError> {
        let model = self.model;
        // Both bounds are at most `i64::MAX` (`slice_range`).
        let in_range =
            value.filter(|v| *v >= model.min_slice as i64 && *v <= model.max_slice as i64);
        match (in_range, model.out_of_range) {
            (Some(value), _) => Ok(value as u64),
            // Below the range too: many servers read a negative or zero limit as none.
            (None, OutOfRange::Cap) => Ok(model.max_slice),
            (None, OutOfRange::Reject) => Err(CostError::Slicing {
                field: field.name.to_string(),
                argument: argument.to_owned(),
                value,
                min: model.min_slice,
                max: model.max_slice,
            }),
        }
    }

    /// True for a variable the request does not give and that has no default of its own:
    /// its argument is left unset (graphql-spec, "CoerceArgumentValues"), as if the query
    /// did not write it. (A variable given as `null` is a value.)
    fn unset(&self, value: &Value) -> bool {
        let Value::Variable(name) = value else {
            return false;
        };
        let given = self
            .variables
            .is_some_and(|variables| variables.contains_key(name.as_str()));
        let defaulted = self
            .definition(name.as_str())
            .is_some_and(|definition| definition.default_value.is_some());
        !given && !defaulted
    }

    /// An integer argument: a literal, or a variable from the request, else its default.
    fn int(&self, value: &Value) -> Option<i64> {
        match value {
            Value::Int(int) => int.as_str().parse().ok(),
            Value::Variable(name) => {
                let given = self
                    .variables
                    .and_then(|variables| variables.get(name.as_str()));
                match given {
                    // Huge or fractional numbers saturate: they are out of range anyway.
                    Some(Json::Number(number)) => number
                        .as_i64()
                        .or_else(|| number.as_f64().map(|float| float as i64)),
                    Some(_) => None,
                    None => self
                        .definition(name.as_str())
                        .and_then(|definition| definition.default_value.as_ref())
                        .and_then(|default| match &**default {
                            Value::Int(int) => int.as_str().parse().ok(),
                            _ => None,
                        }),
                }
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    /// The search for a description steps over each byte a bounded number of times: a
    /// megabyte of quotes and comments with no line's end (`"#"#"#...`) once took each
    /// quote a scan to the end of the document, about 2.7 x 10^11 steps, seconds of a
    /// worker's time for a request refused before the limiter had a say.
    #[test]
    fn the_description_search_is_linear_in_the_document() {
        for hostile in [
            "\"#".repeat(1 << 19),
            "\"#\"\n".repeat(1 << 18),
            "\" # \"".repeat(1 << 18),
            format!("\"{}", " ".repeat(1 << 20)),
            "\" \r#\"\r".repeat(1 << 18),
        ] {
            let (found, steps) = super::described(&hostile);
            assert!(!found);
            assert!(
                steps <= 3 * hostile.len(),
                "{steps} steps for {} bytes",
                hostile.len()
            );
        }
    }

    /// What a document ignores between a description and what it describes
    /// (graphql-spec, "Ignored Tokens"): white space, line terminators (a carriage return
    /// ends a comment as a line feed does), commas, comments, and byte order marks.
    #[test]
    fn a_description_is_found_past_everything_a_document_ignores() {
        for document in [
            "\"x\" query { a }",
            "\"x\" # c\rquery { a }",
            "\"x\"\u{feff}query { a }",
            "\"x\"\n# one\n  , # two\r\n fragment F on T { a }",
            "query Q(\"n\" $n: Int) { a }",
            "\"#\" \"y\" # c\n{ a }",
        ] {
            assert!(super::described(document).0, "{document:?}");
        }
        for document in ["{ a(s: \"x\") }", "{ a(s: \"x\" # c\n) }", "\"x\" # query"] {
            assert!(!super::described(document).0, "{document:?}");
        }
    }
}
