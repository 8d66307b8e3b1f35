//! What the coster takes from a schema (SDL): field types, and the IBM GraphQL cost
//! directives `@cost(weight:)` and `@listSize(assumedSize:, slicingArguments:,
//! sizedFields:, requireOneSlicingArgument:)`. A type's extensions (`extend type`,
//! `extend interface`, `extend union`, `extend schema`) add to it, in any order.

use std::collections::HashMap;

use apollo_compiler::ast::{self, Definition, DirectiveList, OperationType, Value};

use super::CostError;

/// The kind of a named type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// Objects, interfaces and unions: selecting one costs.
    Composite,
    /// Scalars, enums (and unknown types): leaves.
    Leaf,
}

/// `@listSize` on a field.
#[derive(Debug, Clone, Default)]
pub(super) struct ListSize {
    pub(super) assumed_size: Option<u64>,
    pub(super) slicing_arguments: Vec<String>,
    /// Whether `slicingArguments` was written (an empty list says no argument sizes the
    /// list; none written leaves the model's `first`, `last` and `limit` to it).
    pub(super) slicing_written: bool,
    pub(super) sized_fields: Vec<String>,
    pub(super) require_one: bool,
}

#[derive(Debug, Clone)]
pub(super) struct FieldInfo {
    /// The named type the field returns.
    pub(super) ty: String,
    /// Whether it returns a list (of any depth).
    pub(super) list: bool,
    /// `@cost(weight:)` on the field.
    pub(super) weight: Option<u64>,
    pub(super) list_size: Option<ListSize>,
    /// Argument defaults (integers only: that is all slicing needs).
    pub(super) defaults: HashMap<String, i64>,
    /// `@cost(weight:)` on arguments: added when the argument is given.
    pub(super) argument_weights: Vec<(String, u64)>,
}

#[derive(Debug, Clone, Default)]
pub(super) struct TypeInfo {
    pub(super) composite: bool,
    /// `@cost(weight:)` on the type: what a field of it costs (an interface or a union:
    /// the most of its own and its members').
    pub(super) weight: Option<u64>,
    pub(super) fields: HashMap<String, FieldInfo>,
    /// Concrete types (for interfaces and unions), itself for objects.
    pub(super) possible: Vec<String>,
    /// The same, to look one up at once.
    members: std::collections::HashSet<String>,
    pub(super) interfaces: Vec<String>,
}

/// The parts of a schema the coster needs.
#[derive(Debug, Clone, Default)]
pub(super) struct Schema {
    pub(super) types: HashMap<String, TypeInfo>,
    pub(super) roots: HashMap<&'static str, String>,
}

fn directive_int(directives: &DirectiveList, directive: &str, argument: &str) -> Option<i64> {
    directives
        .get(directive)?
        .specified_argument_by_name(argument)
        .and_then(|value| match &**value {
            Value::Int(int) => int.as_str().parse().ok(),
            Value::String(text) => text.parse().ok(),
            _ => None,
        })
}

fn directive_strings(directives: &DirectiveList, directive: &str, argument: &str) -> Vec<String> {
    let Some(value) = directives
        .get(directive)
        .and_then(|directive| directive.specified_argument_by_name(argument))
    else {
        return Vec::new();
    };
    match &**value {
        Value::List(items) => items
            .iter()
            .filter_map(|item| match &**item {
                Value::String(text) => Some(text.clone()),
                _ => None,
            })
            .collect(),
        Value::String(text) => vec![text.clone()],
        _ => Vec::new(),
    }
}

/// A `@cost(weight:)`: an Int, or a String or a Float (IBM's directive takes `"2.5"`) of
/// any number, rounded up (a weight is never lowered by its notation; a negative one is
/// 0).
fn weight(directives: &DirectiveList) -> Option<u64> {
    let value = directives
        .get("cost")?
        .specified_argument_by_name("weight")?;
    let number = match &**value {
        Value::Int(int) => match int.as_str().parse::<i64>() {
            Ok(int) => return Some(int.max(0) as u64),
            Err(_) => int.as_str().parse::<f64>().ok()?,
        },
        Value::Float(float) => float.as_str().parse::<f64>().ok()?,
        Value::String(text) => text.trim().parse::<f64>().ok()?,
        _ => return None,
    };
    // `as` saturates: a weight past u64 is u64::MAX, NaN is 0.
    Some(number.ceil().max(0.0) as u64)
}

fn field_info(field: &ast::FieldDefinition) -> FieldInfo {
    let directives = &field.directives;
    let list_size = directives.get("listSize").map(|directive| {
        let slicing_arguments = directive_strings(directives, "listSize", "slicingArguments");
        let require_one = directive
            .specified_argument_by_name("requireOneSlicingArgument")
            .map_or(!slicing_arguments.is_empty(), |value| {
                matches!(&**value, Value::Boolean(true))
            });
        ListSize {
            assumed_size: directive_int(directives, "listSize", "assumedSize")
                .map(|size| size.max(0) as u64),
            slicing_arguments,
            slicing_written: directive
                .specified_argument_by_name("slicingArguments")
                .is_some(),
            sized_fields: directive_strings(directives, "listSize", "sizedFields"),
            require_one,
        }
    });
    FieldInfo {
        ty: field.ty.inner_named_type().to_string(),
        list: field.ty.is_list(),
        weight: weight(directives),
        list_size,
        defaults: field
            .arguments
            .iter()
            .filter_map(|argument| {
                let default = argument.default_value.as_ref()?;
                match &**default {
                    Value::Int(int) => {
                        Some((argument.name.to_string(), int.as_str().parse().ok()?))
                    }
                    _ => None,
                }
            })
            .collect(),
        argument_weights: field
            .arguments
            .iter()
            .filter_map(|argument| Some((argument.name.to_string(), weight(&argument.directives)?)))
            .collect(),
    }
}

/// Refuses a cost directive the coster would not read as written: an argument it does not
/// know (`@cost(weigth:)`), or of another shape than the directive takes (an enum value
/// `[first]` where the strings `["first"]` are meant, `"true"` where a Boolean is). Read
/// leniently, such a directive was dropped without a word: `slicingArguments: [first]`
/// read as no argument switched off the range check of `first`.
fn check_directives(document: &ast::Document) -> Result<(), CostError> {
    let no_fields: &[apollo_compiler::Node<ast::FieldDefinition>] = &[];
    for definition in &document.definitions {
        let (name, directives, fields) = match definition {
            Definition::ObjectTypeDefinition(d) => (&d.name, &d.directives, &d.fields[..]),
            Definition::ObjectTypeExtension(d) => (&d.name, &d.directives, &d.fields[..]),
            Definition::InterfaceTypeDefinition(d) => (&d.name, &d.directives, &d.fields[..]),
            Definition::InterfaceTypeExtension(d) => (&d.name, &d.directives, &d.fields[..]),
            Definition::UnionTypeDefinition(d) => (&d.name, &d.directives, no_fields),
            Definition::UnionTypeExtension(d) => (&d.name, &d.directives, no_fields),
            Definition::ScalarTypeDefinition(d) => (&d.name, &d.directives, no_fields),
            Definition::ScalarTypeExtension(d) => (&d.name, &d.directives, no_fields),
            Definition::EnumTypeDefinition(d) => (&d.name, &d.directives, no_fields),
            Definition::EnumTypeExtension(d) => (&d.name, &d.directives, no_fields),
            _ => continue,
        };
        check_cost(directives, name.as_str())?;
        for field in fields {
            let place = format!("{name}.{}", field.name);
            check_cost(&field.directives, &place)?;
            check_list_size(&field.directives, &place)?;
            for argument in &field.arguments {
                check_cost(
                    &argument.directives,
                    &format!("{place}({}:)", argument.name),
                )?;
            }
        }
    }
    Ok(())
}

/// The error of a directive argument not read as written.
fn misshapen(
    directive: &str,
    argument: &str,
    place: &str,
    expected: &str,
    value: &Value,
) -> CostError {
    CostError::Parse(format!(
        "schema: @{directive}({argument}:) on {place} must be {expected}, not {value}"
    ))
}

/// `@cost(weight:)` only: an Int, a Float, or a String of a number.
fn check_cost(directives: &DirectiveList, place: &str) -> Result<(), CostError> {
    let Some(directive) = directives.get("cost") else {
        return Ok(());
    };
    for argument in &directive.arguments {
        let value = &*argument.value;
        match (argument.name.as_str(), value) {
            ("weight", Value::Int(_) | Value::Float(_)) => {}
            ("weight", Value::String(text)) if text.trim().parse::<f64>().is_ok() => {}
            ("weight", _) => {
                return Err(misshapen("cost", "weight", place, "a number", value));
            }
            (other, _) => {
                return Err(CostError::Parse(format!(
                    "schema: @cost on {place} has no argument {other:?} (it takes weight)"
                )));
            }
        }
    }
    Ok(())
}

/// `@listSize`: `assumedSize` an Int (or a String of one), `slicingArguments` and
/// `sizedFields` strings (a list of them, or one), `requireOneSlicingArgument` a Boolean.
fn check_list_size(directives: &DirectiveList, place: &str) -> Result<(), CostError> {
    let Some(directive) = directives.get("listSize") else {
        return Ok(());
    };
    let strings = |value: &Value| match value {
        Value::String(_) => true,
        Value::List(items) => items.iter().all(|item| matches!(&**item, Value::String(_))),
        _ => false,
    };
    for argument in &directive.arguments {
        let (name, value) = (argument.name.as_str(), &*argument.value);
        let expected = match name {
            "assumedSize" => match value {
                Value::Int(int) if int.as_str().parse::<i64>().is_ok() => continue,
                Value::String(text) if text.parse::<i64>().is_ok() => continue,
                _ => "an integer",
            },
            "slicingArguments" | "sizedFields" if strings(value) => {
                // IBM's paths into input objects and selections (`filter.max`,
                // `edges.node`) are not followed: a list they size would be priced as one
                // item, or every query of the field refused.
                let path = |item: &Value| match item {
                    Value::String(text) if text.contains('.') => Some(text.to_string()),
                    _ => None,
                };
                let path = match value {
                    Value::List(items) => items.iter().find_map(|item| path(item)),
                    one => path(one),
                };
                if let Some(path) = path {
                    return Err(CostError::Parse(format!(
                        "schema: @listSize on {place} names the path {path:?} in {name}: \
                         paths are not followed; name a top-level argument (or field)"
                    )));
                }
                continue;
            }
            "slicingArguments" | "sizedFields" => "a list of strings",
            "requireOneSlicingArgument" if matches!(value, Value::Boolean(_)) => continue,
            "requireOneSlicingArgument" => "a Boolean",
            other => {
                return Err(CostError::Parse(format!(
                    "schema: @listSize on {place} has no argument {other:?} (it takes \
                     assumedSize, slicingArguments, sizedFields, requireOneSlicingArgument)"
                )));
            }
        };
        return Err(misshapen("listSize", name, place, expected, value));
    }
    Ok(())
}

impl Schema {
    pub(super) fn parse(sdl: &str) -> Result<Self, CostError> {
        let document = apollo_compiler::parser::Parser::new()
            .parse_ast(sdl, "schema.graphql")
            .map_err(|invalid| {
                let errors = invalid.errors.to_string();
                CostError::Parse(errors.lines().next().unwrap_or("invalid schema").to_owned())
            })?;
        check_directives(&document)?;
        let mut schema = Schema::default();
        let mut unions: Vec<(String, Vec<String>)> = Vec::new();
        // A type's definition and its extensions (`extend type`, in any order) add up.
        for definition in &document.definitions {
            match definition {
                Definition::ObjectTypeDefinition(object) => schema.object(
                    &object.name,
                    &object.directives,
                    &object.implements_interfaces,
                    &object.fields,
                ),
                Definition::ObjectTypeExtension(object) => schema.object(
                    &object.name,
                    &object.directives,
                    &object.implements_interfaces,
                    &object.fields,
                ),
                Definition::InterfaceTypeDefinition(interface) => {
                    schema.composite(&interface.name, &interface.directives, &interface.fields);
                }
                Definition::InterfaceTypeExtension(interface) => {
                    schema.composite(&interface.name, &interface.directives, &interface.fields);
                }
                Definition::UnionTypeDefinition(union) => {
                    schema.union(&union.name, &union.directives, &mut unions, &union.members)
                }
                Definition::UnionTypeExtension(union) => {
                    schema.union(&union.name, &union.directives, &mut unions, &union.members)
                }
                Definition::ScalarTypeDefinition(scalar) => {
                    schema.leaf(&scalar.name, &scalar.directives);
                }
                Definition::ScalarTypeExtension(scalar) => {
                    schema.leaf(&scalar.name, &scalar.directives);
                }
                Definition::EnumTypeDefinition(enumeration) => {
                    schema.leaf(&enumeration.name, &enumeration.directives);
                }
                Definition::EnumTypeExtension(enumeration) => {
                    schema.leaf(&enumeration.name, &enumeration.directives);
                }
                Definition::SchemaDefinition(definition) => {
                    schema.roots_from(&definition.root_operations)
                }
                Definition::SchemaExtension(extension) => {
                    schema.roots_from(&extension.root_operations)
                }
                _ => {}
            }
        }
        // Interfaces: every object that implements one is a possible type of it.
        let implementers: Vec<(String, Vec<String>)> = schema
            .types
            .iter()
            .filter(|(_, info)| !info.interfaces.is_empty())
            .map(|(name, info)| (name.clone(), info.interfaces.clone()))
            .collect();
        for (object, interfaces) in implementers {
            for interface in interfaces {
                if let Some(info) = schema.types.get_mut(&interface) {
                    info.possible.push(object.clone());
                }
            }
        }
        for (union, members) in unions {
            if let Some(info) = schema.types.get_mut(&union) {
                info.possible.extend(members);
            }
        }
        for info in schema.types.values_mut() {
            info.members = info.possible.iter().cloned().collect();
        }
        // A field of an interface or a union costs its most expensive member: the server
        // resolves each object, whatever the query selects of it.
        let abstract_weights: Vec<(String, u64)> = schema
            .types
            .iter()
            .filter(|(name, info)| info.composite && info.possible.iter().any(|p| p != *name))
            .filter_map(|(name, info)| {
                let members = info.possible.iter();
                let weights = std::iter::once(info.weight)
                    .chain(members.map(|member| schema.types.get(member)?.weight));
                // Composite types weigh 1 unless given more; with no weight given at all,
                // nothing changes.
                let (given, most) = weights.fold((false, 1), |(given, most), weight| {
                    (given || weight.is_some(), most.max(weight.unwrap_or(1)))
                });
                given.then(|| (name.clone(), most))
            })
            .collect();
        for (name, weight) in abstract_weights {
            if let Some(info) = schema.types.get_mut(&name) {
                info.weight = Some(weight);
            }
        }
        for (slot, default) in [
            ("query", "Query"),
            ("mutation", "Mutation"),
            ("subscription", "Subscription"),
        ] {
            schema
                .roots
                .entry(slot)
                .or_insert_with(|| default.to_owned());
        }
        Ok(schema)
    }

    /// An object type's definition or extension: its fields, weight and interfaces.
    fn object(
        &mut self,
        name: &apollo_compiler::Name,
        directives: &DirectiveList,
        interfaces: &[apollo_compiler::Name],
        fields: &[apollo_compiler::Node<ast::FieldDefinition>],
    ) {
        let info = self.composite(name, directives, fields);
        if info.possible.is_empty() {
            info.possible = vec![name.to_string()];
        }
        info.interfaces
            .extend(interfaces.iter().map(|name| name.to_string()));
    }

    /// A union's definition or extension: its weight, and members to add.
    fn union(
        &mut self,
        name: &apollo_compiler::Name,
        directives: &DirectiveList,
        unions: &mut Vec<(String, Vec<String>)>,
        members: &[apollo_compiler::Name],
    ) {
        self.composite(name, directives, &[]);
        unions.push((
            name.to_string(),
            members.iter().map(|member| member.to_string()).collect(),
        ));
    }

    /// The type `name`, marked composite, with `fields` and the weight of `directives`
    /// added (a weight given once stays).
    fn composite(
        &mut self,
        name: &apollo_compiler::Name,
        directives: &DirectiveList,
        fields: &[apollo_compiler::Node<ast::FieldDefinition>],
    ) -> &mut TypeInfo {
        let info = self.types.entry(name.to_string()).or_default();
        info.composite = true;
        if let Some(weight) = weight(directives) {
            info.weight = Some(weight);
        }
        for field in fields {
            info.fields
                .insert(field.name.to_string(), field_info(field));
        }
        info
    }

    /// A scalar's or an enum's definition or extension: its weight (a weight given once
    /// stays).
    fn leaf(&mut self, name: &apollo_compiler::Name, directives: &DirectiveList) {
        if let Some(weight) = weight(directives) {
            self.types.entry(name.to_string()).or_default().weight = Some(weight);
        }
    }

    /// The root operation types of a `schema` definition or extension.
    fn roots_from(
        &mut self,
        roots: &[apollo_compiler::Node<(OperationType, apollo_compiler::Name)>],
    ) {
        for root in roots {
            let (operation, name) = &**root;
            let slot = match operation {
                OperationType::Query => "query",
                OperationType::Mutation => "mutation",
                OperationType::Subscription => "subscription",
            };
            self.roots.insert(slot, name.to_string());
        }
    }

    pub(super) fn kind(&self, ty: &str) -> Kind {
        match self.types.get(ty) {
            Some(info) if info.composite => Kind::Composite,
            _ => Kind::Leaf,
        }
    }

    /// A field of `ty`, looked up on the type and then on its interfaces.
    pub(super) fn field(&self, ty: &str, name: &str) -> Option<&FieldInfo> {
        let info = self.types.get(ty)?;
        info.fields.get(name).or_else(|| {
            info.interfaces
                .iter()
                .find_map(|interface| self.types.get(interface)?.fields.get(name))
        })
    }

    /// Whether an object of type `concrete` matches a fragment on `condition`.
    pub(super) fn matches(&self, concrete: &str, condition: &str) -> bool {
        concrete == condition
            || self
                .types
                .get(condition)
                .is_some_and(|info| info.members.contains(concrete))
    }

    /// The concrete types a selection on `ty` may meet (itself for objects).
    pub(super) fn possible<'s>(&'s self, ty: &str) -> std::borrow::Cow<'s, [String]> {
        match self.types.get(ty) {
            Some(info) if !info.possible.is_empty() => std::borrow::Cow::Borrowed(&info.possible),
            _ => std::borrow::Cow::Owned(vec![ty.to_owned()]),
        }
    }
}
