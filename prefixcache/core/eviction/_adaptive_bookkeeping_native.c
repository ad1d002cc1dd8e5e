/* adaptive's per-block bookkeeping in C.
 *
 * GhostList, note_taken, sort_released and mark_hashed here keep the contracts of
 * PythonGhostList and the python_ functions in adaptive_bookkeeping.py, which are the
 * reference: the same entries in the same order, the same lists, decision for decision
 * (tests/core/test_adaptive_bookkeeping.py runs both). They exist for speed: adaptive does
 * this for every block the pool takes and every block a request releases, and in Python
 * the interpreter between the few table operations costs more than the rest of the
 * policy's work.
 *
 * A ghost list's keys must be exact bytes (block hashes). Its entries also hold one Python
 * object each (the content's state), so the type takes part in cycle collection. A call
 * that would change a ghost list while another is under way on it (from code a block's
 * attribute runs) raises RuntimeError. Objects an operation lets go of are released only
 * once it has finished, so no code they run can find the list half changed.
 */
#include "_keyed_table.h"
#include <structmember.h>

typedef struct {
    KeyedEntry keyed;
    long long evicted_at;
    PyObject *state; /* owned */
} GhostEntry;

typedef struct {
    PyObject_HEAD
    Py_ssize_t max_size;
    char busy;
    KeyedTable table;
    KeyedList order; /* oldest first */
    /* References an operation dropped, released when it ends. */
    PyObject **dropped;
    Py_ssize_t num_dropped, num_dropped_allocated;
} GhostList;

static PyTypeObject GhostListType;

static inline GhostEntry *
ghost_entry(GhostList *self, Py_ssize_t index)
{
    return (GhostEntry *)keyed_entry(&self->table, index);
}

/* Keep `object` (a reference the caller owns) to release when the operation ends. */
static int
drop_later(GhostList *self, PyObject *object)
{
    if (self->num_dropped == self->num_dropped_allocated) {
        Py_ssize_t n = self->num_dropped_allocated ? self->num_dropped_allocated * 2 : 64;
        PyObject **dropped = PyMem_Realloc(self->dropped, (size_t)n * sizeof(PyObject *));
        if (dropped == NULL) {
            Py_DECREF(object); /* cannot wait: release it now */
            PyErr_NoMemory();
            return -1;
        }
        self->dropped = dropped;
        self->num_dropped_allocated = n;
    }
    self->dropped[self->num_dropped++] = object;
    return 0;
}

/* 0 if the list may be changed now (and marks it busy); else -1 with an error set. */
static int
begin(GhostList *self)
{
    if (self->table.entries == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "GhostList.__init__ did not succeed");
        return -1;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the ghost list is in the middle of a change");
        return -1;
    }
    self->busy = 1;
    return 0;
}

/* The operation is over: release what it dropped (which may run any code). */
static void
end(GhostList *self)
{
    self->busy = 0;
    while (self->num_dropped) {
        PyObject *object = self->dropped[--self->num_dropped];
        Py_DECREF(object);
    }
}

/* Take entry `index` out: its state (a reference now the caller's) and its key. */
static PyObject *
take_out(GhostList *self, Py_ssize_t index)
{
    GhostEntry *e = ghost_entry(self, index);
    PyObject *state = e->state;
    e->state = NULL;
    keyed_list_unlink(&self->table, &self->order, index);
    keyed_table_delete(&self->table, index);
    return state;
}

/* New keys go last; a key present keeps its place with the new values. Steals nothing. */
static int
add(GhostList *self, PyObject *key, long long evicted_at, PyObject *state)
{
    Py_hash_t hash = PyObject_Hash(key); /* bytes: cached, runs no Python code */
    if (hash == -1 || keyed_table_make_room(&self->table) < 0)
        return -1;
    size_t slot;
    Py_ssize_t index = keyed_table_find(&self->table, key, hash, &slot);
    if (index == NONE) {
        index = keyed_table_insert(&self->table, key, hash, slot);
        keyed_list_append(&self->table, &self->order, index);
    }
    else if (drop_later(self, ghost_entry(self, index)->state) < 0) {
        ghost_entry(self, index)->state = Py_NewRef(Py_None);
        return -1;
    }
    GhostEntry *e = ghost_entry(self, index);
    e->evicted_at = evicted_at;
    e->state = Py_NewRef(state);
    return 0;
}

/* Drop the oldest entries while more than max_size are kept. */
static int
trim(GhostList *self)
{
    while (self->order.size > self->max_size) {
        if (drop_later(self, take_out(self, self->order.head)) < 0)
            return -1;
    }
    return 0;
}

static int
check_key(PyObject *key)
{
    if (PyBytes_CheckExact(key))
        return 0;
    PyErr_Format(PyExc_TypeError, "a ghost list's keys must be bytes, not %.100s",
                 Py_TYPE(key)->tp_name);
    return -1;
}

/* -- the type ------------------------------------------------------------------------- */

static PyObject *
GhostList_new(PyTypeObject *type, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kwds))
{
    GhostList *self = (GhostList *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    if (keyed_table_init(&self->table, sizeof(GhostEntry)) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->order = KEYED_EMPTY_LIST;
    return (PyObject *)self;
}

static void
clear_entries(GhostList *self)
{
    for (Py_ssize_t index = 0; index < self->table.num_entries_used; index++) {
        GhostEntry *e = ghost_entry(self, index);
        if (e->keyed.key != NULL && e->state != NULL && drop_later(self, e->state) < 0)
            PyErr_Clear(); /* released at once instead */
        e->state = NULL;
    }
    keyed_table_clear(&self->table);
    self->order = KEYED_EMPTY_LIST;
}

static int
GhostList_init(GhostList *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"max_size", NULL};
    Py_ssize_t max_size;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n", kwlist, &max_size))
        return -1;
    if (max_size < 0) {
        PyErr_SetString(PyExc_ValueError, "max_size must not be negative");
        return -1;
    }
    if (begin(self) < 0)
        return -1;
    clear_entries(self);
    self->max_size = max_size;
    end(self);
    return 0;
}

static int
GhostList_traverse(GhostList *self, visitproc visit, void *arg)
{
    for (Py_ssize_t index = 0; index < self->table.num_entries_used; index++) {
        GhostEntry *e = ghost_entry(self, index);
        if (e->keyed.key != NULL)
            Py_VISIT(e->state);
    }
    for (Py_ssize_t k = 0; k < self->num_dropped; k++)
        Py_VISIT(self->dropped[k]);
    return 0;
}

static int
GhostList_clear(GhostList *self)
{
    if (self->table.entries != NULL && !self->busy) {
        self->busy = 1;
        clear_entries(self);
        end(self);
    }
    return 0;
}

static void
GhostList_dealloc(GhostList *self)
{
    PyObject_GC_UnTrack(self);
    if (self->table.entries != NULL) {
        self->busy = 1;
        clear_entries(self);
        end(self);
        keyed_table_free(&self->table);
    }
    PyMem_Free(self->dropped);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t
GhostList_len(GhostList *self)
{
    return self->order.size;
}

/* The entry holding `key`, NONE if none (also for a key that is not exact bytes). */
static Py_ssize_t
lookup(GhostList *self, PyObject *key, int *failed)
{
    *failed = 0;
    if (self->table.entries == NULL || !PyBytes_CheckExact(key))
        return NONE;
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1) {
        *failed = 1;
        return NONE;
    }
    size_t slot;
    return keyed_table_find(&self->table, key, hash, &slot);
}

static int
GhostList_contains(GhostList *self, PyObject *key)
{
    int failed;
    Py_ssize_t index = lookup(self, key, &failed);
    return failed ? -1 : index != NONE;
}

static PyObject *
GhostList_getitem(GhostList *self, PyObject *key)
{
    int failed;
    Py_ssize_t index = lookup(self, key, &failed);
    if (failed)
        return NULL;
    if (index == NONE) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    GhostEntry *e = ghost_entry(self, index);
    return Py_BuildValue("(LO)", e->evicted_at, e->state);
}

PyDoc_STRVAR(add_doc,
"add(key, evicted_at, state)\n\n"
"A new key goes last; a key present keeps its place, with the new values. Then the\n"
"oldest are dropped while more than max_size are kept.");

static PyObject *
GhostList_add(GhostList *self, PyObject *args)
{
    PyObject *key, *state;
    long long evicted_at;
    if (!PyArg_ParseTuple(args, "OLO", &key, &evicted_at, &state))
        return NULL;
    if (check_key(key) < 0 || begin(self) < 0)
        return NULL;
    int failed = add(self, key, evicted_at, state) < 0 || trim(self) < 0;
    end(self);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(pop_doc,
"pop(key) -> (evicted_at, state)\n\nRemove key and return its values; KeyError if absent.");

static PyObject *
GhostList_pop(GhostList *self, PyObject *key)
{
    if (begin(self) < 0)
        return NULL;
    int failed;
    Py_ssize_t index = lookup(self, key, &failed);
    PyObject *result = NULL;
    if (index == NONE) {
        if (!failed)
            PyErr_SetObject(PyExc_KeyError, key);
    }
    else {
        long long evicted_at = ghost_entry(self, index)->evicted_at;
        PyObject *state = take_out(self, index);
        result = Py_BuildValue("(LO)", evicted_at, state);
        if (drop_later(self, state) < 0)
            Py_CLEAR(result);
    }
    end(self);
    return result;
}

static PyObject *
GhostList_clear_method(GhostList *self, PyObject *Py_UNUSED(ignored))
{
    if (begin(self) < 0)
        return NULL;
    clear_entries(self);
    end(self);
    Py_RETURN_NONE;
}

static PyObject *
GhostList_keys(GhostList *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *keys = PyList_New(0);
    if (keys == NULL || self->table.entries == NULL)
        return keys;
    for (Py_ssize_t index = self->order.head; index != NONE;
         index = ghost_entry(self, index)->keyed.next) {
        if (PyList_Append(keys, ghost_entry(self, index)->keyed.key) < 0) {
            Py_DECREF(keys);
            return NULL;
        }
    }
    return keys;
}

static PyMethodDef GhostList_methods[] = {
    {"add", (PyCFunction)GhostList_add, METH_VARARGS, add_doc},
    {"pop", (PyCFunction)GhostList_pop, METH_O, pop_doc},
    {"clear", (PyCFunction)GhostList_clear_method, METH_NOARGS, "Drop every entry."},
    {"keys", (PyCFunction)GhostList_keys, METH_NOARGS, "The keys, oldest first (a list)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef GhostList_members[] = {
    {"max_size", T_PYSSIZET, offsetof(GhostList, max_size), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods GhostList_as_sequence = {
    .sq_length = (lenfunc)GhostList_len,
    .sq_contains = (objobjproc)GhostList_contains,
};

static PyMappingMethods GhostList_as_mapping = {
    .mp_length = (lenfunc)GhostList_len,
    .mp_subscript = (binaryfunc)GhostList_getitem,
};

static PyTypeObject GhostListType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "prefixcache.core.eviction._adaptive_bookkeeping_native.GhostList",
    .tp_basicsize = sizeof(GhostList),
    .tp_dealloc = (destructor)GhostList_dealloc,
    .tp_as_sequence = &GhostList_as_sequence,
    .tp_as_mapping = &GhostList_as_mapping,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "GhostList(max_size)\n\nadaptive_bookkeeping.py's PythonGhostList, in C "
              "(keys are exact bytes).",
    .tp_traverse = (traverseproc)GhostList_traverse,
    .tp_clear = (inquiry)GhostList_clear,
    .tp_methods = GhostList_methods,
    .tp_members = GhostList_members,
    .tp_init = (initproc)GhostList_init,
    .tp_new = GhostList_new,
};

/* -- per-block bookkeeping ------------------------------------------------------------ */

static PyObject *str_block_id, *str_block_hash;

/* Reading a block's block_id and block_hash, which these functions do for every block a
 * request releases or the pool takes. KVCacheBlock keeps both in __slots__, and a slot's
 * member descriptor says where in the object it is: for a block of the type looked up at
 * the start of a call, an attribute in a slot is read there (what getattr returns,
 * without the lookups each getattr repeats). Any other block, or a slot left empty, goes
 * through getattr. The offsets hold for the whole call: a class whose block_id or
 * block_hash is rebound while a call runs (by code a block's attribute or a state's
 * truth test runs) may have its blocks read as they were at the call's start. */
typedef struct {
    PyTypeObject *type; /* owned; NULL: every block through getattr */
    Py_ssize_t id_offset, hash_offset; /* -1: not a slot of `type` */
} BlockReader;

/* Where instances of `type` keep attribute `name`, if in a slot that getattr reads as it
 * is; else -1. Looks the name up along the type's MRO as an instance's getattr does
 * (_PyType_Lookup: no metaclass, no code run, no exception set). */
static Py_ssize_t
slot_offset(PyTypeObject *type, PyObject *name)
{
    if (type->tp_getattro != PyObject_GenericGetAttr)
        return -1;
    PyObject *descr = _PyType_Lookup(type, name); /* borrowed */
    /* A member descriptor is a data descriptor: it wins over an instance's __dict__. */
    if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)
            || !PyType_IsSubtype(type, PyDescr_TYPE(descr)))
        return -1;
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    return member->type == T_OBJECT_EX ? member->offset : -1;
}

/* A reader for `blocks` (a list), set up for the type of its first block. */
static void
block_reader_init(BlockReader *reader, PyObject *blocks)
{
    reader->type = NULL;
    reader->id_offset = reader->hash_offset = -1;
    if (PyList_GET_SIZE(blocks) == 0)
        return;
    PyTypeObject *type = Py_TYPE(PyList_GET_ITEM(blocks, 0));
    Py_INCREF(type);
    reader->type = type;
    reader->id_offset = slot_offset(type, str_block_id);
    reader->hash_offset = slot_offset(type, str_block_hash);
}

static void
block_reader_release(BlockReader *reader)
{
    Py_CLEAR(reader->type);
}

/* getattr(block, name): a new reference, or NULL with an error set. */
static PyObject *
read_block(const BlockReader *reader, PyObject *block, Py_ssize_t offset, PyObject *name)
{
    if (offset >= 0 && Py_IS_TYPE(block, reader->type)) {
        PyObject *value = *(PyObject **)((char *)block + offset);
        if (value != NULL)
            return Py_NewRef(value);
    }
    return PyObject_GetAttr(block, name); /* also raises for an empty slot */
}

static inline PyObject *
read_block_hash(const BlockReader *reader, PyObject *block)
{
    return read_block(reader, block, reader->hash_offset, str_block_hash);
}

/* Start loading the ghost list's slots for the hashes `blocks` hold (those a slot read
 * gives; it runs no code): the lookups that follow then find them loaded. */
static void
prefetch_ghost_slots(GhostList *ghost, const BlockReader *reader, PyObject *blocks)
{
    if (reader->hash_offset < 0)
        return;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(blocks); k++) {
        PyObject *block = PyList_GET_ITEM(blocks, k);
        if (!Py_IS_TYPE(block, reader->type))
            continue;
        PyObject *block_hash = *(PyObject **)((char *)block + reader->hash_offset);
        if (block_hash != NULL && PyBytes_CheckExact(block_hash))
            keyed_table_prefetch(&ghost->table, PyObject_Hash(block_hash));
    }
}

/* A block's id, checked against both per-block arrays; -1 with an error set if not. */
static Py_ssize_t
block_id_of(const BlockReader *reader, PyObject *block, PyObject *is_reused,
            PyObject *unproven)
{
    PyObject *id_object = read_block(reader, block, reader->id_offset, str_block_id);
    if (id_object == NULL)
        return -1;
    Py_ssize_t block_id = PyLong_AsSsize_t(id_object);
    Py_DECREF(id_object);
    if (block_id == -1 && PyErr_Occurred())
        return -1;
    if (block_id < 0 || block_id >= PyByteArray_GET_SIZE(is_reused)
            || block_id >= PyList_GET_SIZE(unproven)) {
        PyErr_Format(PyExc_IndexError, "block id %zd is out of range", block_id);
        return -1;
    }
    return block_id;
}

/* unproven[block_id] = value, the old value released when the operation ends. */
static int
set_unproven(GhostList *ghost, PyObject *unproven, Py_ssize_t block_id, PyObject *value)
{
    PyObject *old = PyList_GET_ITEM(unproven, block_id);
    PyList_SET_ITEM(unproven, block_id, Py_NewRef(value));
    return drop_later(ghost, old);
}

static int
check_arrays(PyObject *blocks, PyObject *ghost, PyObject *is_reused, PyObject *unproven)
{
    if (!PyList_Check(blocks) || !PyByteArray_Check(is_reused) || !PyList_Check(unproven)
            || !PyObject_TypeCheck(ghost, &GhostListType)) {
        PyErr_SetString(PyExc_TypeError,
                        "expected a list of blocks, a GhostList, a bytearray and a list");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(note_taken_doc,
"note_taken(blocks, ghost, num_evicted, is_reused, unproven, new_marker) -> int\n\n"
"The pool took `blocks` (a list) for new content. For each, in order: its reuse mark\n"
"is cleared; if it holds a hash (about to be evicted), the hash joins the ghost list\n"
"with the eviction count and the block's unproven state, and the count advances; its\n"
"unproven state becomes new_marker. Then the ghost list is trimmed. Returns the\n"
"eviction count. After an error, the blocks before the failing one are done.");

static PyObject *
note_taken(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *blocks, *ghost_object, *is_reused, *unproven, *new_marker;
    long long num_evicted;
    if (!PyArg_ParseTuple(args, "OOLOOO", &blocks, &ghost_object, &num_evicted, &is_reused,
                          &unproven, &new_marker))
        return NULL;
    if (check_arrays(blocks, ghost_object, is_reused, unproven) < 0)
        return NULL;
    GhostList *ghost = (GhostList *)ghost_object;
    if (begin(ghost) < 0)
        return NULL;
    BlockReader reader;
    block_reader_init(&reader, blocks);
    prefetch_ghost_slots(ghost, &reader, blocks);
    int failed = 0;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(blocks) && !failed; k++) {
        PyObject *block = Py_NewRef(PyList_GET_ITEM(blocks, k));
        PyObject *block_hash = read_block_hash(&reader, block);
        Py_ssize_t block_id;
        /* The id is read and checked last: no Python code runs between that and its use. */
        if (block_hash == NULL || (block_hash != Py_None && check_key(block_hash) < 0)
                || (block_id = block_id_of(&reader, block, is_reused, unproven)) < 0) {
            failed = 1;
        }
        else {
            PyByteArray_AS_STRING(is_reused)[block_id] = 0;
            if (block_hash != Py_None) {
                failed = add(ghost, block_hash, num_evicted,
                             PyList_GET_ITEM(unproven, block_id)) < 0;
                num_evicted++;
            }
            if (!failed)
                failed = set_unproven(ghost, unproven, block_id, new_marker) < 0;
        }
        Py_XDECREF(block_hash);
        Py_DECREF(block);
    }
    if (!failed)
        failed = trim(ghost) < 0;
    block_reader_release(&reader);
    end(ghost);
    if (failed)
        return NULL;
    return PyLong_FromLongLong(num_evicted);
}

PyDoc_STRVAR(sort_released_doc,
"sort_released(blocks, finished, is_reused, unproven, ghost, num_evicted, followed_reach,\n"
"              threshold, state, new_marker)\n"
"    -> (unhashed, lower, protected, new, sampled_new, credits)\n\n"
"Where a request's released blocks go, as adaptive_bookkeeping.python_sort_released\n"
"says. After an error, the blocks before the failing one are done.");

static PyObject *
sort_released(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *blocks, *is_reused, *unproven, *ghost_object, *state, *new_marker;
    int finished, threshold;
    long long num_evicted, followed_reach;
    if (!PyArg_ParseTuple(args, "OpOOOLLiOO", &blocks, &finished, &is_reused, &unproven,
                          &ghost_object, &num_evicted, &followed_reach, &threshold, &state,
                          &new_marker))
        return NULL;
    if (check_arrays(blocks, ghost_object, is_reused, unproven) < 0)
        return NULL;
    GhostList *ghost = (GhostList *)ghost_object;
    enum { UNHASHED, LOWER, PROTECTED, NEW, SAMPLED_NEW, CREDITS, NUM_OUT };
    PyObject *out = PyTuple_New(NUM_OUT);
    if (out == NULL)
        return NULL;
    for (int i = 0; i < NUM_OUT; i++) {
        PyObject *list = PyList_New(0);
        if (list == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, list);
    }
#define OUT(i) PyTuple_GET_ITEM(out, i)
    if (begin(ghost) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    BlockReader reader;
    block_reader_init(&reader, blocks);
    prefetch_ghost_slots(ghost, &reader, blocks);
    int failed = 0;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(blocks) && !failed; k++) {
        PyObject *block = Py_NewRef(PyList_GET_ITEM(blocks, k));
        PyObject *block_hash = read_block_hash(&reader, block);
        Py_ssize_t block_id;
        if (block_hash == NULL) {
            failed = 1;
        }
        else if (block_hash == Py_None) {
            failed = PyList_Append(OUT(UNHASHED), block) < 0;
        }
        else if (check_key(block_hash) < 0
                 || (block_id = block_id_of(&reader, block, is_reused, unproven)) < 0) {
            failed = 1;
        }
        else {
            /* The id was read and checked last: the per-block arrays are written before
             * any Python code can run (appending may collect garbage). */
            char *reused = PyByteArray_AS_STRING(is_reused);
            size_t slot;
            Py_ssize_t index;
            if (reused[block_id]) {
                failed = (finished && set_unproven(ghost, unproven, block_id, Py_None) < 0)
                         || PyList_Append(OUT(PROTECTED), block) < 0;
            }
            else if ((index = keyed_table_find(&ghost->table, block_hash,
                                               PyObject_Hash(block_hash), &slot)) != NONE) {
                long long evicted_at = ghost_entry(ghost, index)->evicted_at;
                PyObject *evicted_state = take_out(ghost, index);
                int protect = num_evicted - evicted_at < followed_reach;
                if (protect)
                    reused[block_id] = 1;
                failed = (finished && set_unproven(ghost, unproven, block_id, Py_None) < 0)
                         || PyList_Append(OUT(protect ? PROTECTED : LOWER), block) < 0;
                if (!failed) {
                    /* Unproven new content, wanted again after its eviction. */
                    int credit = PyObject_IsTrue(evicted_state);
                    failed = credit < 0
                             || (credit && PyList_Append(OUT(CREDITS), evicted_state) < 0);
                }
                failed = drop_later(ghost, evicted_state) < 0 || failed;
            }
            else {
                int is_new = finished && PyList_GET_ITEM(unproven, block_id) == new_marker;
                Py_ssize_t size = PyBytes_GET_SIZE(block_hash);
                failed = (is_new && set_unproven(ghost, unproven, block_id, state) < 0)
                         || PyList_Append(OUT(LOWER), block) < 0
                         || (is_new && PyList_Append(OUT(NEW), block) < 0)
                         || (is_new && size > 0
                             && (unsigned char)PyBytes_AS_STRING(block_hash)[size - 1]
                                    < threshold
                             && PyList_Append(OUT(SAMPLED_NEW), block_hash) < 0);
            }
        }
        Py_XDECREF(block_hash);
        Py_DECREF(block);
    }
#undef OUT
    block_reader_release(&reader);
    end(ghost);
    if (failed) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

PyDoc_STRVAR(mark_hashed_doc,
"mark_hashed(blocks, per_block, value) -> None\n\n"
"For each block of the list `blocks` holding a hash, in order: per_block[block_id] =\n"
"value (per_block a list indexed by block id). After an error, the blocks before the\n"
"failing one are done.");

static PyObject *
mark_hashed(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *blocks, *per_block, *value;
    if (!PyArg_ParseTuple(args, "O!O!O", &PyList_Type, &blocks, &PyList_Type, &per_block,
                          &value))
        return NULL;
    /* Replaced values are released at the end: releasing one may run code that changes
     * the lists. */
    PyObject *replaced = PyList_New(0);
    if (replaced == NULL)
        return NULL;
    BlockReader reader;
    block_reader_init(&reader, blocks);
    int failed = 0;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(blocks) && !failed; k++) {
        PyObject *block = Py_NewRef(PyList_GET_ITEM(blocks, k));
        PyObject *block_hash = read_block_hash(&reader, block);
        if (block_hash == NULL) {
            failed = 1;
        }
        else if (block_hash != Py_None) {
            PyObject *id_object = read_block(&reader, block, reader.id_offset, str_block_id);
            Py_ssize_t block_id = id_object ? PyLong_AsSsize_t(id_object) : -1;
            Py_XDECREF(id_object);
            if (block_id == -1 && PyErr_Occurred()) {
                failed = 1;
            }
            else if (block_id < 0 || block_id >= PyList_GET_SIZE(per_block)) {
                PyErr_Format(PyExc_IndexError, "block id %zd is out of range", block_id);
                failed = 1;
            }
            else {
                PyObject *old = PyList_GET_ITEM(per_block, block_id);
                PyList_SET_ITEM(per_block, block_id, Py_NewRef(value));
                failed = PyList_Append(replaced, old) < 0;
                Py_DECREF(old);
            }
        }
        Py_XDECREF(block_hash);
        Py_DECREF(block);
    }
    block_reader_release(&reader);
    Py_DECREF(replaced);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"note_taken", note_taken, METH_VARARGS, note_taken_doc},
    {"sort_released", sort_released, METH_VARARGS, sort_released_doc},
    {"mark_hashed", mark_hashed, METH_VARARGS, mark_hashed_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "prefixcache.core.eviction._adaptive_bookkeeping_native",
    .m_doc = "adaptive's ghost list and per-block bookkeeping in C (see "
             "adaptive_bookkeeping.py).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__adaptive_bookkeeping_native(void)
{
    str_block_id = PyUnicode_InternFromString("block_id");
    str_block_hash = PyUnicode_InternFromString("block_hash");
    if (str_block_id == NULL || str_block_hash == NULL || PyType_Ready(&GhostListType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    Py_INCREF(&GhostListType);
    if (PyModule_AddObject(module, "GhostList", (PyObject *)&GhostListType) < 0) {
        Py_DECREF(&GhostListType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
