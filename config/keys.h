/* keys.h — the key contract: configs/keys.yml gives every key of MaxText's base.yml and of
 * shardsim a class, a type and a default.
 *
 * A key is honoured (read with MaxText's meaning), inert (accepted; cannot change losses,
 * shardings, memory or traffic; listed in run.json) or refused (a feature not simulated: only its
 * default is accepted).  keys.yml is parsed once per process and path (configs point into it);
 * the loader (config.h) classes and types every entry with it and refuses what is not simulated. */
#ifndef CONFIG_KEYS_H
#define CONFIG_KEYS_H

/* A key's class in configs/keys.yml. */
typedef enum {
    MESH_KEY_UNCLASSIFIED = 0, /* no keys.yml for this config */
    MESH_KEY_HONOURED,         /* read by the simulator with MaxText's meaning */
    MESH_KEY_INERT,            /* cannot change losses, shardings, memory or traffic */
    MESH_KEY_REFUSED           /* a feature not simulated: only the default is accepted */
} mesh_key_class;

/* "honoured", "inert", "refused" or "unclassified". */
const char *mesh_key_class_name(mesh_key_class c);

#endif
