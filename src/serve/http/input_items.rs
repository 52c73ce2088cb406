//! `GET /v1/responses/{id}/input_items`: the input items of a stored response, one page at
//! a time, in OpenAI's list shape (`object: "list"`, `data`, `first_id`, `last_id`,
//! `has_more`) with its query parameters `limit` (1 to 100, default 20), `order` (`desc`,
//! the default, or `asc`), `after` and `before` (an item ID of the list; the page holds
//! the items after, or before, it in that order). `include` is accepted and ignored.

use percent_encoding::percent_decode_str;
use serde::Serialize;
use serde_json::Value;

use super::error::ApiError;

/// The default page size, as OpenAI's.
const DEFAULT_LIMIT: usize = 20;

/// The largest page size, as OpenAI's.
const MAX_LIMIT: usize = 100;

/// The order of a listing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Order {
    /// Oldest first.
    Asc,
    /// Newest first (the default).
    Desc,
}

/// The query of a listing, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ListQuery {
    /// Items per page.
    pub limit: usize,
    /// The order.
    pub order: Order,
    /// Start after this item.
    pub after: Option<String>,
    /// End before this item.
    pub before: Option<String>,
}

/// One page of a listing.
#[derive(Serialize, Debug, PartialEq)]
pub(crate) struct ItemPage {
    /// `list`.
    pub object: &'static str,
    /// The items of the page.
    pub data: Vec<Value>,
    /// The ID of the page's first item (null for an empty page).
    pub first_id: Option<String>,
    /// The ID of the page's last item (null for an empty page).
    pub last_id: Option<String>,
    /// Whether more items follow the page in this order.
    pub has_more: bool,
}

/// Parses a query string (`limit=2&order=asc&after=msg_1`); a bad value is a 400 naming
/// the parameter. Unknown parameters are ignored.
pub(crate) fn parse_query(query: Option<&str>) -> Result<ListQuery, ApiError> {
    let mut q = ListQuery { limit: DEFAULT_LIMIT, order: Order::Desc, after: None, before: None };
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = value.replace('+', " ");
        let value = percent_decode_str(&value).decode_utf8().map_err(|_| {
            ApiError::invalid(Some(key), format!("the value of `{key}` is not UTF-8 once percent-decoded"))
        })?;
        match key {
            "limit" => {
                q.limit =
                    value.parse::<usize>().ok().filter(|n| (1..=MAX_LIMIT).contains(n)).ok_or_else(|| {
                        ApiError::invalid(
                            Some("limit"),
                            format!("limit must be an integer from 1 to {MAX_LIMIT}, got {value:?}"),
                        )
                    })?;
            }
            "order" => {
                q.order = match value.as_ref() {
                    "asc" => Order::Asc,
                    "desc" => Order::Desc,
                    other => {
                        return Err(ApiError::invalid(
                            Some("order"),
                            format!("order must be \"asc\" or \"desc\", got {other:?}"),
                        ));
                    }
                };
            }
            "after" => q.after = Some(value.into_owned()),
            "before" => q.before = Some(value.into_owned()),
            _ => {}
        }
    }
    Ok(q)
}

/// The ID of an item (every listed item has one).
fn item_id(item: &Value) -> Option<&str> {
    item.get("id").and_then(Value::as_str)
}

/// The page of `items` (oldest first, as stored) that `query` asks for. An `after` or
/// `before` that names no item of the list is a 400 naming it.
pub(crate) fn page(items: &[Value], query: &ListQuery) -> Result<ItemPage, ApiError> {
    let mut ordered: Vec<&Value> = items.iter().collect();
    if query.order == Order::Desc {
        ordered.reverse();
    }
    let position = |param: &str, id: &str| {
        ordered.iter().position(|item| item_id(item) == Some(id)).ok_or_else(|| {
            ApiError::invalid(Some(param), format!("no input item of this response has the ID {id:?}"))
        })
    };
    let start = match &query.after {
        Some(id) => position("after", id)? + 1,
        None => 0,
    };
    let end = match &query.before {
        Some(id) => position("before", id)?,
        None => ordered.len(),
    };
    let window = ordered.get(start..end.max(start)).unwrap_or_default();
    let data: Vec<Value> = window.iter().take(query.limit).map(|v| (*v).clone()).collect();
    Ok(ItemPage {
        object: "list",
        first_id: data.first().and_then(item_id).map(str::to_string),
        last_id: data.last().and_then(item_id).map(str::to_string),
        has_more: window.len() > data.len(),
        data,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn items(n: usize) -> Vec<Value> {
        (1..=n).map(|i| json!({"id": format!("msg_{i}"), "type": "message"})).collect()
    }

    fn ids(p: &ItemPage) -> Vec<&str> {
        p.data.iter().filter_map(item_id).collect()
    }

    #[test]
    fn pages_walk_the_list_both_ways() {
        let all = items(5);
        let q = parse_query(None).unwrap();
        assert_eq!((q.limit, q.order), (20, Order::Desc));
        let p = page(&all, &q).unwrap();
        assert_eq!(ids(&p), ["msg_5", "msg_4", "msg_3", "msg_2", "msg_1"]);
        assert_eq!(
            (p.first_id.as_deref(), p.last_id.as_deref(), p.has_more),
            (Some("msg_5"), Some("msg_1"), false)
        );

        let q = parse_query(Some("order=asc&limit=2")).unwrap();
        let p = page(&all, &q).unwrap();
        assert_eq!((ids(&p), p.has_more), (vec!["msg_1", "msg_2"], true));
        let q = parse_query(Some("order=asc&limit=2&after=msg_2")).unwrap();
        assert_eq!(ids(&page(&all, &q).unwrap()), ["msg_3", "msg_4"]);
        let q = parse_query(Some("order=asc&limit=2&after=msg_4")).unwrap();
        let p = page(&all, &q).unwrap();
        assert_eq!((ids(&p), p.has_more), (vec!["msg_5"], false));
        let q = parse_query(Some("limit=2&before=msg_2")).unwrap();
        let p = page(&all, &q).unwrap();
        assert_eq!((ids(&p), p.has_more), (vec!["msg_5", "msg_4"], true));
        let q = parse_query(Some("after=msg_1")).unwrap();
        let p = page(&all, &q).unwrap();
        assert_eq!((p.data.len(), p.first_id, p.has_more), (0, None, false));
        let q = parse_query(Some("after=msg%5F3&include%5B%5D=x")).unwrap();
        assert_eq!(ids(&page(&all, &q).unwrap()), ["msg_2", "msg_1"], "values are percent-decoded");
    }

    #[test]
    fn bad_queries_name_the_parameter() {
        for (query, param) in
            [("limit=0", "limit"), ("limit=101", "limit"), ("limit=x", "limit"), ("order=up", "order")]
        {
            assert_eq!(parse_query(Some(query)).unwrap_err().param.as_deref(), Some(param), "{query}");
        }
        let q = parse_query(Some("after=nope")).unwrap();
        assert_eq!(page(&items(2), &q).unwrap_err().param.as_deref(), Some("after"));
    }
}
