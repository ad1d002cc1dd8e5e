/* Keyed entries for the eviction policies' C structures: an array of entries, each with an
 * exact bytes key, found through an open-addressing table (linear probing, deletion by
 * backward shift), and linked by index into doubly linked lists that carry every order.
 * Each slot carries its entry's index and the low 32 bits of its key's hash, so that
 * probing past other keys, and moving them when one is deleted, reads only the slots:
 * the tables are larger than the CPU's caches, and every entry or key read on the way
 * would be a miss of its own.
 * The table's order never matters, so the per-process randomized hash of bytes is fine to
 * place keys with.
 *
 * An entry type begins with a KeyedEntry and adds what its structure keeps per key; the
 * table knows only its size. The table holds one reference to each key; anything an
 * entry adds is its owner's to manage. Nothing here calls back into Python, so no Python
 * code runs in the middle of an operation.
 */
#ifndef PREFIXCACHE_KEYED_TABLE_H
#define PREFIXCACHE_KEYED_TABLE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(_MSC_VER) && (defined(_M_X64) || defined(_M_IX86))
#include <xmmintrin.h>
#endif

#define NONE ((Py_ssize_t)-1) /* no entry: an empty slot, the end of a list */

typedef struct {
    PyObject *key; /* a bytes object, owned; NULL while the entry is free */
    Py_hash_t hash;
    Py_ssize_t prev, next; /* within its list; the free list chains through next */
} KeyedEntry;

typedef struct {
    Py_ssize_t head, tail, size;
} KeyedList;

/* A table holds fewer than 2**30 keys (OverflowError beyond), so it never uses more than
 * 2**30 entries, whose indices fit a slot's 32 bits, nor more than 2**31 slots, whose
 * mask the hash's low 32 bits cover: a key's home slot is found from its slot alone. */
#define KEYED_MAX_KEYS ((Py_ssize_t)1 << 30)

typedef struct {
    int32_t index;      /* entry index, or NONE */
    uint32_t hash_low;  /* the low 32 bits of the entry's key's hash */
} KeyedSlot;

typedef struct {
    char *entries;
    size_t entry_size;
    Py_ssize_t num_entries_allocated, num_entries_used, free_entry;
    KeyedSlot *slots;
    size_t slot_mask;
    Py_ssize_t num_keys;
} KeyedTable;

#define KEYED_EMPTY_LIST ((KeyedList){NONE, NONE, 0})

static inline KeyedEntry *
keyed_entry(const KeyedTable *table, Py_ssize_t index)
{
    return (KeyedEntry *)(table->entries + (size_t)index * table->entry_size);
}

/* -- lists ---------------------------------------------------------------------------- */

static inline void
keyed_list_append(KeyedTable *table, KeyedList *list, Py_ssize_t index)
{
    KeyedEntry *e = keyed_entry(table, index);
    e->prev = list->tail;
    e->next = NONE;
    if (list->tail == NONE)
        list->head = index;
    else
        keyed_entry(table, list->tail)->next = index;
    list->tail = index;
    list->size++;
}

static inline void
keyed_list_unlink(KeyedTable *table, KeyedList *list, Py_ssize_t index)
{
    KeyedEntry *e = keyed_entry(table, index);
    if (e->prev == NONE)
        list->head = e->next;
    else
        keyed_entry(table, e->prev)->next = e->next;
    if (e->next == NONE)
        list->tail = e->prev;
    else
        keyed_entry(table, e->next)->prev = e->prev;
    list->size--;
}

/* -- the table ------------------------------------------------------------------------ */

static inline int
keyed_table_place_all(KeyedTable *table, size_t num_slots)
{
    KeyedSlot *slots = PyMem_Malloc(num_slots * sizeof(KeyedSlot));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < num_slots; i++)
        slots[i].index = (int32_t)NONE;
    PyMem_Free(table->slots);
    table->slots = slots;
    table->slot_mask = num_slots - 1;
    for (Py_ssize_t index = 0; index < table->num_entries_used; index++) {
        KeyedEntry *e = keyed_entry(table, index);
        if (e->key == NULL)
            continue;
        size_t i = (size_t)e->hash & table->slot_mask;
        while (slots[i].index != NONE)
            i = (i + 1) & table->slot_mask;
        slots[i].index = (int32_t)index;
        slots[i].hash_low = (uint32_t)e->hash;
    }
    return 0;
}

/* An empty table of entries of entry_size bytes; 0, or -1 with MemoryError set. */
static inline int
keyed_table_init(KeyedTable *table, size_t entry_size)
{
    Py_ssize_t num_entries = 64;
    memset(table, 0, sizeof(*table));
    table->entry_size = entry_size;
    table->free_entry = NONE;
    table->entries = PyMem_Malloc(num_entries * entry_size);
    if (table->entries == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    table->num_entries_allocated = num_entries;
    if (keyed_table_place_all(table, 128) < 0) {
        PyMem_Free(table->entries);
        table->entries = NULL;
        return -1;
    }
    return 0;
}

/* Room for one more key: the table at most half full, and a free entry. */
static inline int
keyed_table_make_room(KeyedTable *table)
{
    if (table->num_keys + 1 >= KEYED_MAX_KEYS) {
        PyErr_SetString(PyExc_OverflowError, "too many keys for one table");
        return -1;
    }
    if ((size_t)(table->num_keys + 1) * 2 > table->slot_mask + 1) {
        if (table->slot_mask + 1 > PY_SSIZE_T_MAX / 2 / sizeof(KeyedSlot)) {
            PyErr_NoMemory();
            return -1;
        }
        if (keyed_table_place_all(table, (table->slot_mask + 1) * 2) < 0)
            return -1;
    }
    if (table->free_entry == NONE && table->num_entries_used == table->num_entries_allocated) {
        if ((size_t)table->num_entries_allocated > PY_SSIZE_T_MAX / 2 / table->entry_size) {
            PyErr_NoMemory();
            return -1;
        }
        Py_ssize_t n = table->num_entries_allocated * 2;
        char *entries = PyMem_Realloc(table->entries, (size_t)n * table->entry_size);
        if (entries == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        table->entries = entries;
        table->num_entries_allocated = n;
    }
    return 0;
}

/* Ask the CPU to start loading the slot where a key of `hash` is looked for: a caller
 * with several keys to look up starts every load before the first lookup, so that the
 * misses overlap instead of following one another. Only a hint: it changes nothing. */
static inline void
keyed_table_prefetch(const KeyedTable *table, Py_hash_t hash)
{
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(&table->slots[(size_t)hash & table->slot_mask]);
#elif defined(_MSC_VER) && (defined(_M_X64) || defined(_M_IX86))
    _mm_prefetch((const char *)&table->slots[(size_t)hash & table->slot_mask], _MM_HINT_T0);
#else
    (void)table;
    (void)hash;
#endif
}

/* keyed_table_prefetch for each of the n keys that is exact bytes (the rest are the
 * caller's to refuse); hashing bytes runs no code. */
static inline void
keyed_table_prefetch_keys(const KeyedTable *table, PyObject *const *keys, Py_ssize_t n)
{
    for (Py_ssize_t k = 0; k < n; k++) {
        if (PyBytes_CheckExact(keys[k]))
            keyed_table_prefetch(table, PyObject_Hash(keys[k]));
    }
}

/* The entry holding `key` (exact bytes), or NONE with *slot where it would go. */
static inline Py_ssize_t
keyed_table_find(const KeyedTable *table, PyObject *key, Py_hash_t hash, size_t *slot)
{
    Py_ssize_t size = PyBytes_GET_SIZE(key);
    const char *data = PyBytes_AS_STRING(key);
    uint32_t hash_low = (uint32_t)hash;
    size_t i = (size_t)hash & table->slot_mask;
    for (;;) {
        const KeyedSlot *s = &table->slots[i];
        if (s->index == NONE) {
            *slot = i;
            return NONE;
        }
        if (s->hash_low == hash_low) {
            KeyedEntry *e = keyed_entry(table, s->index);
            if (e->key == key
                || (e->hash == hash && PyBytes_GET_SIZE(e->key) == size
                    && memcmp(PyBytes_AS_STRING(e->key), data, size) == 0))
                return s->index;
        }
        i = (i + 1) & table->slot_mask;
    }
}

/* Add `key` at `slot` (from keyed_table_find, after keyed_table_make_room); returns its
 * entry, in no list yet. */
static inline Py_ssize_t
keyed_table_insert(KeyedTable *table, PyObject *key, Py_hash_t hash, size_t slot)
{
    Py_ssize_t index = table->free_entry;
    if (index != NONE)
        table->free_entry = keyed_entry(table, index)->next;
    else
        index = table->num_entries_used++;
    KeyedEntry *e = keyed_entry(table, index);
    Py_INCREF(key);
    e->key = key;
    e->hash = hash;
    table->slots[slot].index = (int32_t)index;
    table->slots[slot].hash_low = (uint32_t)hash;
    table->num_keys++;
    return index;
}

/* Drop entry `index`, already out of its list: its slot and its key. */
static inline void
keyed_table_delete(KeyedTable *table, Py_ssize_t index)
{
    KeyedEntry *e = keyed_entry(table, index);
    size_t mask = table->slot_mask;
    size_t i = (size_t)e->hash & mask;
    while (table->slots[i].index != index)
        i = (i + 1) & mask;
    /* Backward shift: move later keys of the probe run into the hole, unless the slot
     * they hash to lies cyclically after the hole (they would become unreachable). */
    for (;;) {
        table->slots[i].index = (int32_t)NONE;
        size_t j = i;
        for (;;) {
            j = (j + 1) & mask;
            KeyedSlot other = table->slots[j];
            if (other.index == NONE)
                goto shifted;
            size_t home = (size_t)other.hash_low & mask;
            int home_after_hole = i <= j ? (i < home && home <= j) : (i < home || home <= j);
            if (!home_after_hole) {
                table->slots[i] = other;
                i = j;
                break;
            }
        }
    }
shifted:;
    PyObject *key = e->key;
    e->key = NULL;
    e->next = table->free_entry;
    table->free_entry = index;
    table->num_keys--;
    Py_DECREF(key);
}

/* Drop every key (the caller has dropped what its entries add) and empty the slots. */
static inline void
keyed_table_clear(KeyedTable *table)
{
    for (Py_ssize_t index = 0; index < table->num_entries_used; index++)
        Py_CLEAR(keyed_entry(table, index)->key);
    for (size_t i = 0; i <= table->slot_mask; i++)
        table->slots[i].index = (int32_t)NONE;
    table->num_entries_used = 0;
    table->free_entry = NONE;
    table->num_keys = 0;
}

/* Free the arrays after keyed_table_clear (or with no keys ever added). */
static inline void
keyed_table_free(KeyedTable *table)
{
    PyMem_Free(table->entries);
    PyMem_Free(table->slots);
    table->entries = NULL;
    table->slots = NULL;
}

#endif
